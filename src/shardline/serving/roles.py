"""What an engine serves: coupled (every request prefills and decodes here), or one role of
disaggregated serving (disagg/prefill.py, disagg/decode.py). A role is given to the engine, not
made by subclassing it: it orders the waiting queue, tends its own queue once a round (streams
arriving), takes a KV move of its own as it lands (a Moved out of the pipeline's outcomes: an
export of a stream that left, an import), takes the streams the scheduler's plan handed off, and
gives the scheduler its `Handoffs` policy (which streams leave, whose KV is exported). KV moves
themselves are plan items (pipeline/plan.py), asked for on the scheduler's KvTable.

Every hook runs on the engine thread, except `order` (under the engine's lock) and `empty`.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from shardline.pipeline.plan import KvMove
from shardline.serving.scheduler import Handoffs
from shardline.serving.stream import Stream

if TYPE_CHECKING:
    from shardline.serving.engine import Engine, Ticket


class Role(Protocol):
    handoffs: Handoffs | None  # the scheduler's policy for streams leaving this instance (None: none leave)

    def bind(self, engine: Engine) -> None: ...
    def order(self, waiting: deque[Ticket], n: int) -> list[Ticket]: ...  # the n that start now, off the queue
    def tend(self) -> None: ...  # each round: the role's own queue (streams arriving)
    def moved(self, item: KvMove) -> None: ...  # a KV move landed (an export of a stream that left, an import)
    def left(self, streams: list[Stream]) -> None: ...  # handed off by the plan, their exports under way
    def drop(self) -> list[Ticket]: ...  # the engine stops: the tickets the role holds, to be ended
    def empty(self) -> bool: ...  # the role holds no request


class Coupled:
    """Every request prefills and decodes on this engine, oldest first; nothing moves."""

    handoffs: Handoffs | None = None

    def bind(self, engine: Engine) -> None:
        pass

    def order(self, waiting: deque[Ticket], n: int) -> list[Ticket]:
        return [waiting.popleft() for _ in range(n)]

    def tend(self) -> None:
        pass

    def moved(self, item: KvMove) -> None:
        pass

    def left(self, streams: list[Stream]) -> None:
        raise AssertionError("a coupled engine hands no stream off")

    def drop(self) -> list[Ticket]:
        return []

    def empty(self) -> bool:
        return True
