"""A prefill instance: an engine over its own pipeline that only prefills (TetriInfer).

Requests wait in its queue; its local policy (FCFS, SJF, LJF) orders each batch of up to
`batch` queued requests, which then run to their end before the next batch is ordered
(non-preemptive: a short prompt arriving meanwhile waits). Prompts go through in fixed-size
chunks, one prompt at a time. When a prompt's last chunk has sampled its first token (sent to
the caller from here, so the time to first token never waits for a transfer), the stream
leaves: its KV is exported in queue order (behind every step already submitted), its key
released, and the stream with its KV, its book and its predicted decode length is handed to
`send` (the front end's dispatcher), which gives it to a decode instance.

Invariants:
- A stream is in at most one place: this engine's scheduler, its exports in transit, or
  handed on. Once handed on, this engine never touches its ticket again.
- Every ticket gets exactly one final event: here (stop, length 1, cancelled, an export that
  failed, a dispatch that failed, the engine stopping) or from the decode instance.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from shardline.disagg.policies import DEFAULT_PREFILL_BATCH, PrefillPolicy, Queued, next_batch
from shardline.disagg.predictor import LengthPredictor
from shardline.disagg.state import LengthRange, PrefillLoad, bucket
from shardline.errors import ShardlineError
from shardline.pipeline.kv import Handoff, KvSnapshot, handoff, join
from shardline.pipeline.plan import Pipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Ticket
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.stream import Stream

log = logging.getLogger("shardline.disagg")


@dataclass(frozen=True, eq=False)
class Moving:
    """A prefilled stream on its way to a decode instance: the caller's ticket, the stream's
    record (its id is the prefill instance's key: the decode instance gives it its own), its
    KV with the book of it, and its predicted decode length."""

    ticket: Ticket
    stream: Stream
    handoff: Handoff
    predicted: LengthRange

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.prefix())


@dataclass(eq=False)
class _Export:
    """A stream leaving: its KV's slices on their way out of the stages (one, the whole cache,
    for a request-level transfer; the chunks' slices and the rest for a chunk-level one)."""

    ticket: Ticket
    stream: Stream
    predicted: LengthRange
    slices: list[Future[KvSnapshot]]

    def done(self) -> bool:
        return all(f.done() for f in self.slices)

    def error(self) -> BaseException | None:
        return next((e for f in self.slices if (e := f.exception()) is not None), None)

    def kv(self) -> KvSnapshot:
        return join([f.result() for f in self.slices])


# A prefilled stream's predicted decode length, named as it leaves: from its request (an oracle)
# or from what stage 0 saw of its prompt (stream.handover.hidden, made by a summarizing pipeline).
Predict = Callable[[Stream], LengthRange]


class PrefillEngine(Engine):
    def __init__(self, pipe: Pipeline, limits: Limits, max_context: int, chunk: int,
                 send: Callable[[Moving], None], predict: Predict,
                 policy: PrefillPolicy = PrefillPolicy.FCFS, batch: int = DEFAULT_PREFILL_BATCH,
                 replays: Replays | None = None, chunked_kv: bool = False) -> None:
        """`chunked_kv`: chunk-level KV transfer. Each prompt chunk's slots are exported once it
        has run (in queue order, before the stream's next chunk), so a leaving stream's export
        is its last chunk's slots alone; else the whole cache is exported as it leaves."""
        self.send, self.predict, self.policy, self.batch = send, predict, policy, batch
        self.chunked_kv = chunked_kv
        self._batch_left = 0  # tickets at the head of the queue that form the current batch
        self._exports: deque[_Export] = deque()  # engine thread only
        # No decode groups: a stream never decodes here. One prompt at a time, in policy order.
        scheduling = SchedulerConfig(chunk=chunk, groups=0, max_prefills=1, pacing=None)  # fixed chunks (TetriInfer)
        super().__init__(pipe, limits, max_context, scheduling, None, replays)

    def load(self) -> PrefillLoad:
        """What the cluster monitor reads (any thread): requests waiting for or in their
        prefill, and their prompt tokens not yet prefilled."""
        with self._lock:
            waiting = [len(t.request.prompt) for t in self._waiting]
        streams = self._streams()
        prefilling = [s for s in streams if not s.decoding]
        left = sum(max(1, len(s.prefix()) - s.prefilled) for s in prefilling)
        return PrefillLoad(len(waiting) + len(prefilling), sum(waiting) + left, any(s.in_flight for s in streams))

    def empty(self) -> bool:
        """No request here: none waiting, prefilling or leaving (any thread; a flip checks it)."""
        return not self._exports and self.active == 0 and self.waiting == 0

    # --- the engine thread ---------------------------------------------------------------------

    def _next_waiting(self, n: int) -> list[Ticket]:
        out = []
        for _ in range(n):
            if self._batch_left == 0:
                self._order_batch()
            out.append(self._waiting.popleft())
            self._batch_left -= 1
        return out

    def _order_batch(self) -> None:
        """The next `batch` queued tickets, reordered in place by the policy (under the lock)."""
        window = [self._waiting.popleft() for _ in range(min(self.batch, len(self._waiting)))]
        order = next_batch([Queued(t.id, t.id, len(t.request.prompt)) for t in window], self.policy, self.batch)
        by_id = {t.id: t for t in window}
        self._waiting.extendleft(reversed([by_id[q.id] for q in order]))
        self._batch_left = len(window)

    def _stepped(self, stream: Stream) -> None:
        if stream.decoding and not stream.done:
            self._leave(stream)
        elif self.chunked_kv and not stream.decoding:
            stream.handover.kv_sent.append(self._export_rest(stream))

    def _export_rest(self, stream: Stream) -> Future[KvSnapshot]:
        """The slots of `stream`'s cache not exported yet, queued behind its steps so far (none
        is in flight: the book's slots are those the stages hold)."""
        future = self.pipe.export_kv(stream.key, stream.handover.kv_through)
        stream.handover.kv_through = stream.book.slots
        return future

    def _leave(self, stream: Stream) -> None:
        """`stream` has its first token: the rest of its KV is exported (all of it, unless
        chunk by chunk), then its key released (queue order)."""
        ticket = self._ticket(stream)
        slices = [*stream.handover.kv_sent, self._export_rest(stream)]
        stream.handover.kv_sent, stream.handover.kv_through = [], 0  # the slices leave with the export, not the stream
        self.scheduler.remove(stream)
        self._release_slot()
        ticket.stream = None
        predicted = self.predict(stream)
        stream.handover.expect = predicted.lo
        self._exports.append(_Export(ticket, stream, predicted, slices))
        for f in slices:
            f.add_done_callback(lambda _: self.pipe.wake())

    def _admit(self) -> None:
        self._hand_on()
        super()._admit()

    def _hand_on(self) -> None:
        """Exports that finished go on to `send`, in the order they left."""
        while self._exports and self._exports[0].done():
            x = self._exports.popleft()
            kv, error = None, x.error()
            if error is None:
                try:
                    kv = x.kv()
                except ShardlineError as e:  # slices that do not join
                    error = e
            if error is not None or kv is None:
                x.ticket.on_event(Event(None, finish="error", error=f"the KV export failed: {error}"))
            elif x.ticket.cancelled:
                x.ticket.on_event(Event(None, finish="cancelled"))
            else:
                self._send(x, kv)

    def _send(self, x: _Export, kv: KvSnapshot) -> None:
        try:
            self.send(Moving(x.ticket, x.stream, handoff(kv, x.stream.book), x.predicted))
        except Exception as e:  # noqa: BLE001 - no decode instance takes it: this request alone fails
            log.warning("request %d: no decode instance took it (%s: %s)", x.ticket.id, type(e).__name__, e)
            x.ticket.on_event(Event(None, finish="error", error=f"no decode instance took the request: {e}"))

    def _fail_all(self, reason: str, error: str) -> None:
        exports, self._exports = list(self._exports), deque()
        for x in exports:
            try:
                x.ticket.on_event(Event(None, finish=reason, error=error))
            except Exception:  # noqa: BLE001 - logged; the others must still be told
                log.exception("while ending a request")
        super()._fail_all(reason, error)


def oracle_predict(g: int, buckets: int) -> Predict:
    """A request's decode length taken from its max_tokens (exact for requests that ignore
    end-of-text, as the benchmark's do), as the bucket of width `g` a predictor would name."""
    return lambda s: bucket(s.max_tokens, g, buckets)


def trained_predict(predictor: LengthPredictor) -> Predict:
    """The trained classifier over what stage 0 saw of the prompt. A stream without that summary
    (a pipeline that does not summarize) or whose features the model refuses is predicted its
    max_tokens instead, with a warning: the request goes on; only the scheduler's guess is worse."""
    def predict(s: Stream) -> LengthRange:
        try:
            if s.handover.hidden is None:
                raise ShardlineError("no stage-0 summary of its prompt")
            return predictor.predict(s.handover.hidden.vector())
        except ShardlineError as e:
            log.warning("stream %d: predicted by its max_tokens (%s)", s.id, e)
            return bucket(s.max_tokens, predictor.g, predictor.buckets)

    return predict
