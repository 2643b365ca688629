"""What comes back from a pipeline's threads to whoever drives it (one consumer), one way: each
step's Outcomes, and a Moved for each KV move that finished (`watch`). A caller's message (a
request, a cancel, an arrival) ends the consumer's wait with a Wake, which `take` never returns."""

from __future__ import annotations

import queue
from dataclasses import dataclass

from shardline.pipeline.plan import KvMove, Moved, Outcome


@dataclass(frozen=True)
class Wake:
    """A caller's message waits for the consumer: its wait for outcomes ends now."""


class Outbox:
    def __init__(self) -> None:
        self._q: queue.Queue[Outcome | Moved | Wake] = queue.Queue()

    def put(self, outcome: Outcome | Moved) -> None:
        self._q.put(outcome)

    def watch(self, item: KvMove) -> None:
        """A Moved for `item` once its `done` is complete (at once if it is already)."""
        item.done.add_done_callback(lambda _: self._q.put(Moved(item)))

    def wake(self) -> None:
        self._q.put(Wake())

    def take(self, timeout: float | None) -> list[Outcome | Moved]:
        """Block until at least one item (or a wake, or the timeout), then take all ready."""
        try:
            out = [self._q.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return [o for o in out if not isinstance(o, Wake)]
