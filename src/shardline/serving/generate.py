"""One request through the engine, as a plain iterator of its tokens (`shardline generate`, tests):
the same path as every request `shardline serve` takes."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator

from shardline.config import SamplingConfig
from shardline.errors import ShardlineError
from shardline.serving.engine import Engine, Event, Request


def generate(engine: Engine, prompt: list[int], sampling: SamplingConfig, stop_ids: Iterable[int],
             timeout_s: float = 600.0, on_final: Callable[[Event], None] | None = None) -> Iterator[Event]:
    """The request's token events in order (the final event is not yielded: it ends the
    iteration, after `on_final`, or raises ShardlineError when the request failed). Leaving
    early cancels it."""
    events: queue.Queue[Event] = queue.Queue()
    ticket = engine.submit(Request(prompt, sampling, frozenset(stop_ids)), events.put)
    try:
        while True:
            try:
                ev = events.get(timeout=timeout_s)
            except queue.Empty:
                raise ShardlineError(f"no token within {timeout_s:g} s") from None
            if ev.token is None:
                if ev.finish == "error":
                    raise ShardlineError(ev.error)
                if on_final is not None:
                    on_final(ev)
                return
            yield ev
    finally:
        engine.cancel(ticket)  # a no-op for a request that has ended


def tokens(engine: Engine, prompt: list[int], sampling: SamplingConfig, stop_ids: Iterable[int] = ()) -> list[int]:
    return [ev.token for ev in generate(engine, prompt, sampling, stop_ids) if ev.token is not None]
