"""A decode instance: an engine over its own pipeline, in the decode role: it takes prefilled
streams and decodes them in decode groups (TetriInfer).

A stream arrives (`adopt`, any thread) with its KV. It waits in the instance's queue until
the admission policy (instance.py: vanilla, reserve-static, reserve-dynamic, on the low end of
each prediction) and a free stream slot let it in; then its KV is imported on a fresh lease of
this engine by the next plan (a KvImport item), and once that is done it joins the scheduler
as a decoding stream: the token sampled at the end of its prefill is fed next. A stream that outlives its prediction
decodes on; nothing is evicted.

Invariants:
- The stream record moves with the request and keeps its id; only its lease (the key of its
  state here) and its book change on arrival.
- Every arrival gets exactly one final event: cancelled or failed before it runs, or from
  the engine when it ends.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from functools import partial

from shardline.disagg.instance import Admission, Running, admits
from shardline.disagg.prefill import Moving
from shardline.disagg.state import DecodeLoad, LengthRange
from shardline.pipeline.plan import KvMove, Pipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, EngineFailed, Event, Ticket
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.replay import Replays
from shardline.serving.scheduler import Handoffs, SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.serving.stream import Stream

log = logging.getLogger("shardline.disagg")


class DecodeRole:
    """What makes an engine a decode instance: the arrivals' queue, their admission, and their
    KV imports (plan items) until they are in."""

    handoffs: Handoffs | None = None  # nothing leaves a decode instance

    def __init__(self, admission: Admission, kv_tokens: int, heavy_from: int) -> None:
        self.admission, self.kv_tokens, self.heavy_from = admission, kv_tokens, heavy_from
        self._lock = threading.Lock()  # guards _arrivals (callers' threads)
        self._arrivals: deque[Moving] = deque()  # adopted, not yet admitted
        self._landing: deque[tuple[Moving, Future[None]]] = deque()  # engine thread: importing
        self.engine: Engine

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def adopt(self, moving: Moving) -> None:
        """Take a prefilled stream (any thread). It waits here until admitted."""
        with self._lock:
            if self.engine.failed:
                raise EngineFailed(f"the decode engine has stopped: {self.engine.failed}")
            self._arrivals.append(moving)
        self.engine.pipe.wake()

    def load(self) -> DecodeLoad:
        """What the cluster monitor reads (any thread)."""
        with self._lock:
            queued = len(self._arrivals)
        return self._load(self.engine.streams(), queued + len(self._landing))

    def empty(self) -> bool:
        return not self._arrivals and not self._landing

    def _load(self, streams: list[Stream], queued: int) -> DecodeLoad:
        heavy = sum(s.handover.expect >= self.heavy_from for s in streams)
        used = min(self.kv_tokens, sum(_held(s) for s in streams))
        return DecodeLoad(len(streams), heavy, len(streams) - heavy, used, self.kv_tokens, queued)

    # --- the engine thread ---------------------------------------------------------------------

    def order(self, waiting: deque[Ticket], n: int) -> list[Ticket]:
        return [waiting.popleft() for _ in range(n)]

    def left(self, streams: list[Stream]) -> None:
        raise AssertionError("a decode instance hands no stream off")

    def tend(self) -> None:
        self._take_arrivals()

    def moved(self, item: KvMove) -> None:
        self._land()

    def _take_arrivals(self) -> None:
        """Arrivals in order, while the head is admitted (it waits rather than being overtaken)."""
        while True:
            with self._lock:
                if not self._arrivals:
                    return
                head = self._arrivals[0]
                if not head.ticket.cancelled and not self.engine.take_slot(partial(self._fits, head)):
                    return
                self._arrivals.popleft()
            if head.ticket.cancelled:
                head.ticket.on_event(Event(None, finish="cancelled"))
            else:
                self._import(head)

    def _fits(self, m: Moving) -> bool:
        streams = list(self.engine.scheduler.streams.values())
        running = [Running(len(s.prefix()), len(s.generated), LengthRange(s.handover.expect)) for s in streams]
        return (admits(self.admission, self._load(streams, 0), m.predicted, m.prompt_tokens, running)
                and self.engine.scheduler.room(m.handoff.kv.slots))

    def _import(self, m: Moving) -> None:
        """`m`'s KV goes in on a fresh lease of this engine with the next plan; the stream joins
        the scheduler once it is in (its id is the one it had on the prefill instance)."""
        stream = m.stream
        done = self.engine.scheduler.arrive(stream, m.handoff)
        stream.owner, stream.in_flight, stream.sent = m.ticket, False, None
        self._landing.append((m, done))
        if done.done():  # refused before any plan took it (no room after all): no Moved will come
            self._land()

    def _land(self) -> None:
        while self._landing and self._landing[0][1].done():
            m, done = self._landing.popleft()
            if (error := done.exception()) is not None:
                self.engine.release_slot()
                self.engine.scheduler.unarrive(m.stream)
                m.ticket.on_event(Event(None, finish="error", error=f"the KV import failed: {error}"))
            elif m.ticket.cancelled:
                self.engine.release_slot()
                self.engine.scheduler.unarrive(m.stream)
                m.ticket.on_event(Event(None, finish="cancelled"))
            else:
                m.ticket.stream = m.stream
                self.engine.scheduler.add(m.stream)

    def drop(self) -> list[Ticket]:
        with self._lock:
            tickets = [m.ticket for m in self._arrivals]
            self._arrivals.clear()
        tickets += [m.ticket for m, _ in self._landing]
        self._landing.clear()
        return tickets


def decode_instance(pipe: Pipeline, limits: Limits, max_context: int, scheduling: SchedulerConfig,
                    admission: Admission, kv_tokens: int, heavy_from: int, drafts: Drafts | None = None,
                    replays: Replays | None = None, paged: PagedScheduler | None = None) -> DecodeRole:
    """An engine over `pipe` in the decode role (`paged`: a paged pipeline's scheduler, an
    arriving stream's KV written into blocks it takes)."""
    role = DecodeRole(admission, kv_tokens, heavy_from)
    Engine(pipe, limits, max_context, scheduling, drafts, replays, role, scheduler=paged)
    return role


def _held(s: Stream) -> int:
    """KV token slots a stream holds: its prefix and the tokens generated after it."""
    return len(s.prefix()) + len(s.generated) - s.resumed
