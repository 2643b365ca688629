"""A decode instance: an engine over its own pipeline that takes prefilled streams and decodes
them in decode groups (TetriInfer).

A stream arrives (`adopt`, any thread) with its KV. It waits in the instance's queue until
the admission policy (instance.py: vanilla, reserve-static, reserve-dynamic, on the low end of
each prediction) and a free stream slot let it in; then its KV is imported on a lease of
this engine, in queue order, and once that is done it joins the scheduler as a decoding stream: the
token sampled at the end of its prefill is fed next. A stream that outlives its prediction
decodes on; nothing is evicted.

Invariants:
- The stream record moves with the request and keeps its id; only its lease (the key of its
  state here) and its book change on arrival.
- Every arrival gets exactly one final event: cancelled or failed before it runs, or from
  the engine when it ends.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future

from shardline.disagg.instance import Admission, Running, admits
from shardline.disagg.prefill import Moving
from shardline.disagg.state import DecodeLoad, LengthRange
from shardline.pipeline.plan import Pipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, EngineFailed, Event
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.serving.stream import Stream

log = logging.getLogger("shardline.disagg")


class DecodeEngine(Engine):
    def __init__(self, pipe: Pipeline, limits: Limits, max_context: int, scheduling: SchedulerConfig,
                 admission: Admission, kv_tokens: int, heavy_from: int, drafts: Drafts | None = None,
                 replays: Replays | None = None) -> None:
        self.admission, self.kv_tokens, self.heavy_from = admission, kv_tokens, heavy_from
        self._arrivals: deque[Moving] = deque()  # under the lock: adopted, not yet admitted
        self._landing: deque[tuple[Moving, Future[None]]] = deque()  # engine thread: importing
        super().__init__(pipe, limits, max_context, scheduling, drafts, replays)

    def adopt(self, moving: Moving) -> None:
        """Take a prefilled stream (any thread). It waits here until admitted."""
        with self._lock:
            if self.failed:
                raise EngineFailed(f"the decode engine has stopped: {self.failed}")
            self._arrivals.append(moving)
        self.pipe.wake()

    def load(self) -> DecodeLoad:
        """What the cluster monitor reads (any thread)."""
        with self._lock:
            queued = len(self._arrivals)
        return self._load(self._streams(), queued + len(self._landing))

    def empty(self) -> bool:
        """No request here: none arriving, importing or decoding (any thread; a flip checks it)."""
        return not self._arrivals and not self._landing and self.active == 0 and self.waiting == 0

    def _load(self, streams: list[Stream], queued: int) -> DecodeLoad:
        heavy = sum(s.handover.expect >= self.heavy_from for s in streams)
        used = min(self.kv_tokens, sum(_held(s) for s in streams))
        return DecodeLoad(len(streams), heavy, len(streams) - heavy, used, self.kv_tokens, queued)

    # --- the engine thread ---------------------------------------------------------------------

    def _admit(self) -> None:
        super()._admit()
        self._land()
        self._take_arrivals()

    def _take_arrivals(self) -> None:
        """Arrivals in order, while the head is admitted (it waits rather than being overtaken)."""
        while True:
            with self._lock:
                if not self._arrivals:
                    return
                head = self._arrivals[0]
                if not head.ticket.cancelled and not self._fits(head):
                    return
                self._arrivals.popleft()
                self._taken += not head.ticket.cancelled
            if head.ticket.cancelled:
                head.ticket.on_event(Event(None, finish="cancelled"))
            else:
                self._import(head)

    def _fits(self, m: Moving) -> bool:
        if self._taken >= self.limits.max_streams:
            return False
        streams = list(self.scheduler.streams.values())
        running = [Running(len(s.prefix()), len(s.generated), LengthRange(s.handover.expect)) for s in streams]
        load = self._load(streams, 0)
        return admits(self.admission, load, m.predicted, m.prompt_tokens, running)

    def _import(self, m: Moving) -> None:
        """`m`'s KV goes in on a lease of this engine; it joins the scheduler once it is in (its
        id is the one it had on the prefill instance)."""
        stream = m.stream
        stream.key, stream.book, stream.owner = self._lease(), m.handoff.book(), m.ticket
        stream.in_flight, stream.sent = False, None
        future = self.pipe.import_kv(stream.key, m.handoff.kv)
        self._landing.append((m, future))
        future.add_done_callback(lambda _: self.pipe.wake())

    def _land(self) -> None:
        while self._landing and self._landing[0][1].done():
            m, future = self._landing.popleft()
            if (error := future.exception()) is not None:
                self._release_slot()
                m.ticket.on_event(Event(None, finish="error", error=f"the KV import failed: {error}"))
            elif m.ticket.cancelled:
                self._release_slot()
                self.pipe.release(m.stream.key)
                m.ticket.on_event(Event(None, finish="cancelled"))
            else:
                m.ticket.stream = m.stream
                self.scheduler.add(m.stream)

    def _fail_all(self, reason: str, error: str) -> None:
        with self._lock:
            waiting = [m.ticket for m in self._arrivals]
            self._arrivals.clear()
        waiting += [m.ticket for m, _ in self._landing]
        self._landing.clear()
        for ticket in waiting:
            try:
                ticket.on_event(Event(None, finish=reason, error=error))
            except Exception:  # noqa: BLE001 - logged; the others must still be told
                log.exception("while ending a request")
        super()._fail_all(reason, error)


def _held(s: Stream) -> int:
    """KV token slots a stream holds: its prefix and the tokens generated after it."""
    return len(s.prefix()) + len(s.generated) - s.resumed
