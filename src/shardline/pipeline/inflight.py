"""Outcomes on their way from a pipeline's threads to whoever drives it (one consumer)."""

from __future__ import annotations

import queue

from shardline.pipeline.plan import Outcome

WAKE = -1  # an Outcome for this stream only wakes the consumer; `take` never returns it


class Outbox:
    def __init__(self) -> None:
        self._q: queue.Queue[Outcome] = queue.Queue()

    def put(self, outcome: Outcome) -> None:
        self._q.put(outcome)

    def wake(self) -> None:
        self._q.put(Outcome(WAKE))

    def take(self, timeout: float | None) -> list[Outcome]:
        """Block until at least one outcome (or a wake, or the timeout), then take all ready."""
        try:
            out = [self._q.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return [o for o in out if o.stream != WAKE]
