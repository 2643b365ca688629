"""Steps in flight: what a pipeline hands back when a submitted step comes out of the chain.

A pipeline that keeps several streams in flight (microbatching) runs each stream's step through
its stages while other streams' steps occupy the other stages. Each stream has at most one step
in flight; its result (a token, or the reason it failed) comes back as one `Outcome`.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from shardline.decoding.sampler import Choice
from shardline.pipeline.timing import Timing


@dataclass(frozen=True)
class Outcome:
    stream: int
    choice: Choice | None  # None when the step failed
    error: str = ""
    timing: Timing | None = None  # where the step's time went (pipelines with workers)


class Outbox:
    """Outcomes from the pipeline's threads to whoever drives it (one consumer)."""

    def __init__(self) -> None:
        self._q: queue.Queue[Outcome] = queue.Queue()
        self._held: dict[int, Outcome] = {}

    def put(self, outcome: Outcome) -> None:
        self._q.put(outcome)

    def take(self, timeout: float | None) -> list[Outcome]:
        """Block until at least one outcome (or the timeout), then take all that are ready."""
        out = list(self._held.values())
        self._held.clear()
        if not out:
            try:
                out.append(self._q.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def wait_for(self, stream: int, timeout: float | None = None) -> Outcome:
        """The outcome of one stream (others that arrive meanwhile are held for `take`)."""
        if stream in self._held:
            return self._held.pop(stream)
        while True:
            try:
                got = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no result for stream {stream} within {timeout} s") from None
            if got.stream == stream:
                return got
            self._held[got.stream] = got
