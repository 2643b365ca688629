"""A prefill instance: an engine over its own pipeline, in the prefill role: it only prefills (TetriInfer).

Requests wait in its queue; its local policy (FCFS, SJF, LJF) orders each batch of up to
`batch` queued requests, which then run to their end before the next batch is ordered
(non-preemptive: a short prompt arriving meanwhile waits). Prompts go through in fixed-size
chunks, one prompt at a time. When a prompt's last chunk has sampled its first token (sent to
the caller from here, so the time to first token never waits for a transfer), the stream
leaves: the scheduler's next plan exports its KV (behind every step already submitted) and
releases its lease (PrefillOnly, the handoff policy it is given), and the stream with its KV,
its book and its predicted decode length is handed to `send` (the front end's dispatcher),
which gives it to a decode instance.

Invariants:
- A stream is in at most one place: this engine's scheduler, leaving (its exports in
  transit), or handed on. Once handed on, this engine never touches its ticket again.
- Every ticket gets exactly one final event: here (stop, length 1, cancelled, an export that
  failed, a dispatch that failed, the engine stopping) or from the decode instance.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardline.disagg.policies import DEFAULT_PREFILL_BATCH, PrefillPolicy, Queued, next_batch
from shardline.disagg.state import LengthRange, PrefillLoad, bucket
from shardline.errors import ShardlineError
from shardline.pipeline.kv import Handoff, KvSnapshot, join
from shardline.pipeline.plan import KvMove, Pipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Ticket, ticket_of
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.prefix import PrefixCache
from shardline.serving.replay import Replays
from shardline.serving.scheduler import Handoffs, SchedulerConfig
from shardline.serving.stream import Stream

if TYPE_CHECKING:  # the predictor's features run stage 0's graph (OpenVINO); the role only passes it on
    from shardline.disagg.predictor import LengthPredictor

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
class _Leaving:
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


@dataclass(frozen=True)
class PrefillOnly:
    """The prefill instance's handoff policy, which its scheduler is given (serving/scheduler.py
    Handoffs): a stream leaves once its prompt is prefilled and its first token out (a stream
    that ends there, on a stop or at length 1, ends here); with `chunked_kv`, each prompt chunk's
    slots are exported once it has run, before the stream's next chunk, so a leaving stream's
    export is its last chunk's slots alone (on a paged pipeline: its full blocks written since,
    so every slice starts at a block; the last one takes the rest)."""

    chunked_kv: bool = False

    def leaves(self, s: Stream) -> bool:
        return s.decoding and not s.done

    def exports(self, s: Stream) -> bool:
        return self.chunked_kv and s.prefilling


class PrefillRole:
    """What makes an engine a prefill instance: its policy's batches, its handoff policy, and
    the leaving streams until their exports are done and they are sent on."""

    def __init__(self, send: Callable[[Moving], None], predict: Predict, policy: PrefillPolicy = PrefillPolicy.FCFS,
                 batch: int = DEFAULT_PREFILL_BATCH, chunked_kv: bool = False) -> None:
        self.send, self.predict, self.policy, self.batch = send, predict, policy, batch
        self.handoffs: Handoffs | None = PrefillOnly(chunked_kv)
        self._batch_left = 0  # tickets at the head of the queue that form the current batch
        self._leaving: deque[_Leaving] = deque()  # engine thread only
        self.engine: Engine

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def load(self) -> PrefillLoad:
        """What the cluster monitor reads (any thread): requests waiting for or in their
        prefill, and their prompt tokens not yet prefilled."""
        waiting = [len(t.request.prompt) for t in self.engine.queued()]
        streams = self.engine.streams()
        prefilling = [s for s in streams if not s.decoding]
        left = sum(max(1, len(s.prefix()) - s.prefilled) for s in prefilling)
        return PrefillLoad(len(waiting) + len(prefilling), sum(waiting) + left, any(s.in_flight for s in streams))

    def empty(self) -> bool:
        return not self._leaving

    def order(self, waiting: deque[Ticket], n: int) -> list[Ticket]:
        out = []
        for _ in range(n):
            if self._batch_left == 0:
                self._order_batch(waiting)
            out.append(waiting.popleft())
            self._batch_left -= 1
        return out

    def _order_batch(self, waiting: deque[Ticket]) -> None:
        """The next `batch` queued tickets, reordered in place by the policy (under the lock)."""
        window = [waiting.popleft() for _ in range(min(self.batch, len(waiting)))]
        order = next_batch([Queued(t.id, t.id, len(t.request.prompt)) for t in window], self.policy, self.batch)
        by_id = {t.id: t for t in window}
        waiting.extendleft(reversed([by_id[q.id] for q in order]))
        self._batch_left = len(window)

    def left(self, streams: list[Stream]) -> None:
        """Streams the plan handed off, their exports under way: the engine lets them go."""
        for stream in streams:
            ticket = ticket_of(stream)
            slices, stream.handover.kv_sent, stream.handover.kv_through = stream.handover.kv_sent, [], 0
            self.engine.release_slot()
            ticket.stream = None
            predicted = self.predict(stream)
            stream.handover.expect = predicted.lo
            self._leaving.append(_Leaving(ticket, stream, predicted, slices))

    def tend(self) -> None:
        pass

    def moved(self, item: KvMove) -> None:
        """An export landed: the streams whose exports are all in go on to `send`, in the order
        they left."""
        while self._leaving and self._leaving[0].done():
            x = self._leaving.popleft()
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

    def _send(self, x: _Leaving, kv: KvSnapshot) -> None:
        try:
            self.send(Moving(x.ticket, x.stream, self.engine.scheduler.handoff(x.stream, kv), x.predicted))
        except Exception as e:  # noqa: BLE001 - no decode instance takes it: this request alone fails
            log.warning("request %d: no decode instance took it (%s: %s)", x.ticket.id, type(e).__name__, e)
            x.ticket.on_event(Event(None, finish="error", error=f"no decode instance took the request: {e}"))

    def drop(self) -> list[Ticket]:
        leaving, self._leaving = list(self._leaving), deque()
        return [x.ticket for x in leaving]


def prefill_instance(pipe: Pipeline, limits: Limits, max_context: int, chunk: int, send: Callable[[Moving], None],
                     predict: Predict, policy: PrefillPolicy = PrefillPolicy.FCFS, batch: int = DEFAULT_PREFILL_BATCH,
                     replays: Replays | None = None, chunked_kv: bool = False,
                     prefix: PrefixCache | None = None, paged: PagedScheduler | None = None) -> PrefillRole:
    """An engine over `pipe` in the prefill role (`chunked_kv`: chunk-level KV transfer; else the
    whole cache is exported as a stream leaves). No decode groups: a stream never decodes here;
    one prompt at a time, in fixed chunks (TetriInfer), in the policy's order. With `prefix`,
    each leaving stream's prompt is kept here, and a prompt starting with a kept one prefills
    only the rest: its export still carries its whole KV (the copy's slots and the rest's).
    `paged`: a paged pipeline's scheduler (its blocks, its prefix reuse by block), the stream's
    blocks exported whole as it leaves."""
    role = PrefillRole(send, predict, policy, batch, chunked_kv)
    scheduling = SchedulerConfig(chunk=chunk, groups=0, max_prefills=1, pacing=None)
    Engine(pipe, limits, max_context, scheduling, None, replays, role, prefix, scheduler=paged)
    return role


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
            return predictor.predict(s.handover.hidden.vector(len(s.prefix())))
        except ShardlineError as e:
            log.warning("stream %d: predicted by its max_tokens (%s)", s.id, e)
            return bucket(s.max_tokens, predictor.g, predictor.buckets)

    return predict
