"""The serving engine: many streams through one pipeline, each stage kept busy.

One engine thread owns the pipeline. Its loop reads in three lines: admit waiting requests,
apply cancellations, and turn every finished step into the stream's next step. Every live
stream always has its next step in flight, so with N stages and >= N streams each stage works
on some stream at every moment (microbatching by interleaving).

Invariants:
- A stream has at most one step in flight; its KV is freed (`close`) only when none is.
- Events for a ticket are delivered in order, from the engine thread, ending with one
  `Event` whose `finish` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol

from shardline.config import SamplingConfig
from shardline.decoding.sampler import top_logprobs
from shardline.errors import ShardlineError
from shardline.pipeline.inflight import Outbox, Outcome
from shardline.serving.admission import Limits, accepts, to_admit
from shardline.stage.cache import Decode, Prefill, Step

log = logging.getLogger("shardline.engine")
WAKE = -1  # an Outcome for this stream id only wakes the engine loop


class Pipeline(Protocol):
    outbox: Outbox

    def open(self, sampling: SamplingConfig | None = None) -> int: ...
    def close(self, stream: int) -> None: ...
    def submit(self, stream: int, step: Step) -> None: ...
    def outcomes(self, timeout: float | None = None) -> list[Outcome]: ...


class Overloaded(ShardlineError):
    """Every stream slot is busy and the waiting queue is full."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: SamplingConfig  # max_tokens included
    stop_ids: frozenset[int]


@dataclass(frozen=True)
class Event:
    token: int | None  # None on the final event
    logprob: float = 0.0
    finish: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str = ""
    # The most likely tokens at this position and their log-probabilities, most likely first
    # (as many as the request's SamplingConfig.logprobs; empty when it asked for none).
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Ticket:
    """The caller's handle on one request."""

    id: int
    request: Request
    on_event: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False


@dataclass
class _Live:
    ticket: Ticket
    stream: int
    generated: int = 0
    in_flight: bool = False


class Engine:
    def __init__(self, pipe: Pipeline, limits: Limits, max_context: int) -> None:
        self.pipe = pipe
        self.limits = limits
        self.max_context = max_context
        self._waiting: deque[Ticket] = deque()
        self._live: dict[int, _Live] = {}  # by stream id
        self._cancels: deque[Ticket] = deque()
        self._lock = threading.Lock()  # guards _waiting, _cancels and _taken (callers' threads)
        # Stream slots held: admitted and not yet finished. Counted under the lock from the
        # moment a ticket leaves the queue, so a ticket between the queue and `_live` still
        # counts when a caller checks whether there is room.
        self._taken = 0
        self._ids = count()
        self._running = True
        self.failed: str | None = None  # why the engine thread stopped, if it did (then unhealthy)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine")
        self._thread.start()

    # --- callers' side (any thread) ----------------------------------------------------------

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket:
        if not request.prompt:
            raise ShardlineError("the prompt is empty")
        need = len(request.prompt) + request.sampling.max_tokens
        if need > self.max_context:
            raise ShardlineError(f"prompt of {len(request.prompt)} tokens plus {request.sampling.max_tokens} "
                                 f"new tokens exceeds the context of {self.max_context}")
        with self._lock:
            if not accepts(len(self._waiting), self._taken, self.limits):
                raise Overloaded(f"all {self.limits.max_streams} streams are busy and "
                                 f"{len(self._waiting)} requests are waiting")
            ticket = Ticket(next(self._ids), request, on_event)
            self._waiting.append(ticket)
        self._wake()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for `ticket` and free its stream (e.g. the client went away)."""
        with self._lock:
            self._cancels.append(ticket)
        self._wake()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._live)

    def stop(self) -> None:
        self._running = False
        self._wake()
        self._thread.join(timeout=10)

    def _wake(self) -> None:
        self.pipe.outbox.put(Outcome(WAKE, None))

    # --- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while self._running:
            self._apply_cancels()
            self._admit()
            for outcome in self.pipe.outcomes(timeout=1.0):
                if outcome.stream != WAKE:
                    self._on_outcome(outcome)
        for live in list(self._live.values()):
            self._finish(live, "cancelled")

    def _admit(self) -> None:
        with self._lock:
            n = to_admit(len(self._waiting), self._taken, self.limits)
            starting = [self._waiting.popleft() for _ in range(n)]
            self._taken += n
        for ticket in starting:
            if ticket.cancelled:
                self._release()
                ticket.on_event(Event(None, finish="cancelled"))
                continue
            try:
                stream = self.pipe.open(ticket.request.sampling)
            except ShardlineError as e:
                self._release()
                ticket.on_event(Event(None, finish="error", error=str(e)))
                continue
            live = self._live[stream] = _Live(ticket, stream)
            self._step(live, Prefill(ticket.request.prompt))

    def _apply_cancels(self) -> None:
        with self._lock:
            tickets, self._cancels = list(self._cancels), deque()
        for ticket in tickets:
            ticket.cancelled = True  # a waiting ticket is dropped when its turn comes
            live = next((v for v in self._live.values() if v.ticket is ticket), None)
            if live is not None and not live.in_flight:
                self._finish(live, "cancelled")

    def _on_outcome(self, outcome: Outcome) -> None:
        live = self._live.get(outcome.stream)
        if live is None:
            return
        live.in_flight = False
        ticket = live.ticket
        if outcome.choice is None:
            return self._finish(live, "error", outcome.error)
        if ticket.cancelled:
            return self._finish(live, "cancelled")
        token = outcome.choice.token
        if token in ticket.request.stop_ids:
            return self._finish(live, "stop")
        live.generated += 1
        n, logits = ticket.request.sampling.logprobs, outcome.choice.logits
        top = tuple(top_logprobs(logits, n)) if n and logits is not None else ()
        ticket.on_event(Event(token, outcome.choice.logprob, top=top))
        if ticket.cancelled:  # the callback may cancel (a stop string in the text)
            return self._finish(live, "cancelled")
        if live.generated >= ticket.request.sampling.max_tokens:
            return self._finish(live, "length")
        self._step(live, Decode(token))

    def _step(self, live: _Live, step: Step) -> None:
        try:
            self.pipe.submit(live.stream, step)
        except ShardlineError as e:
            return self._finish(live, "error", str(e))
        except Exception as e:  # a bug or a lost device fails this stream, not the server
            log.exception("step of stream %d failed", live.stream)
            return self._finish(live, "error", f"internal error: {type(e).__name__}: {e}")
        live.in_flight = True

    def _release(self) -> None:
        with self._lock:
            self._taken -= 1

    def _finish(self, live: _Live, reason: str, error: str = "") -> None:
        if self._live.pop(live.stream, None) is not None:
            self._release()
        self.pipe.close(live.stream)
        live.ticket.on_event(Event(None, finish=reason, error=error))
