"""The serving engine: many streams through one pipeline, each stage kept busy.

One engine thread owns the streams. Each round (`step`) reads in a few lines: take the outcomes
that came back and apply them to their streams, apply cancellations, let the role tend its
queues, admit waiting requests, then execute the round's `Plan` (KV exports, releases, KV
imports, steps) that the scheduler makes, and give the streams it handed off to the role
(roles.py: coupled, or a disaggregated prefill or decode instance). Graph work
never runs on this thread (every stage has its own), so planning and applying outcomes never
wait for a long prompt.

Invariants:
- A stream has at most one step in flight; it ends (its keys released) only when none is.
- Events for a ticket are delivered in order, from the engine thread, ending with one
  `Event` whose `finish` is set.
- An exception while applying one stream's outcome fails that stream alone. If the loop itself
  dies, `failed` says why, every request gets an error event, and new ones are refused.
- A stream whose step the pipeline lost (it broke under it) is replayed (replay.py): it starts
  again under a new lease with its id, and its caller sees one uninterrupted answer.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol

from shardline.config import SamplingConfig
from shardline.decoding.masks import Constraint
from shardline.decoding.sampler import Choice
from shardline.errors import ShardlineError
from shardline.host import trim_memory_every
from shardline.pipeline.plan import AnyStep, DecodeStep, KvMove, Lease, Moved, Outcome, Pipeline, Plan, execute
from shardline.pipeline.ragged_step import RaggedStep
from shardline.serving.admission import Limits, accepts, to_admit
from shardline.serving.constrained import brief
from shardline.serving.engine_spec import SpecDriver
from shardline.serving.kv_blocks import BlockCounts
from shardline.serving.prefix import PrefixCache, PrefixStats
from shardline.serving.replay import Replays, refusal
from shardline.serving.roles import Coupled, Role
from shardline.serving.scheduler import KeyedScheduler, Scheduler, SchedulerConfig
from shardline.serving.speculation import Drafts, SpecStats
from shardline.serving.status import stall
from shardline.serving.stops import Detokenizer, StopText
from shardline.serving.stream import Stream, new_stream_id

log = logging.getLogger("shardline.engine")


class Overloaded(ShardlineError):
    """Every stream slot is busy and the waiting queue is full."""


class EngineFailed(ShardlineError):
    """The engine thread has stopped: nothing more can be served."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: SamplingConfig  # max_tokens included
    stop_ids: frozenset[int]
    speculative: bool = True  # when the server speculates: this request may (False: plain decoding)
    stops: tuple[str, ...] = ()  # stop sequences, checked on the text where stop ids are checked
    # The request's text comes with its events when given (needed for `stops`): the caller's
    # tokenizer, a fresh streaming detokenizer per request.
    detokenizer: Callable[[], Detokenizer] | None = None
    # Prefix reuse (serving/prefix.py), when the engine keeps prefixes: whose kept prefixes it
    # may start from and join (an API key's), and whether it may at all ("cache_prompt").
    scope: str = ""
    cache_prompt: bool = True
    # Constrained decoding (issue 40): the request's grammar state, its own (decoding/grammar.py).
    constraint: Constraint | None = None


@dataclass(frozen=True)
class Event:
    token: int | None  # None on the final event
    logprob: float = 0.0
    finish: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str = ""
    # The most likely tokens at this position and their log-probabilities, most likely first
    # (as many as the request's SamplingConfig.logprobs; empty when it asked for none).
    top: tuple[tuple[int, float], ...] = ()
    spec: SpecStats | None = None  # on the final event of a request that speculated
    # With a detokenizer: the text this event lets the client see (held-back text is flushed on
    # the final event), and where this token's own text starts among the characters decoded.
    text: str = ""
    offset: int = 0
    cut: bool = False  # this token completed a stop sequence: the text is cut before it (then the end)
    # With an error: "constraint" when the request's own grammar could not go on (the client's
    # to fix: the API answers 400 naming its field); "" for the server's own failures.
    cause: str = ""


@dataclass(eq=False)
class Ticket:
    """The caller's handle on one request."""

    id: int
    request: Request
    on_event: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    stream: Stream | None = None  # once admitted
    text: StopText | None = None  # with the request's detokenizer: what its client sees


def ticket_of(stream: Stream) -> Ticket:
    """The caller's ticket of a stream an engine runs."""
    assert isinstance(stream.owner, Ticket)
    return stream.owner


class Serving(Protocol):
    """What the HTTP app serves through: one Engine, or a front end over several instances
    (disagg/front.py)."""

    @property
    def limits(self) -> Limits: ...
    @property
    def waiting(self) -> int: ...
    @property
    def active(self) -> int: ...
    @property
    def failed(self) -> str | None: ...  # why it cannot serve, if it cannot (then unhealthy)
    @property
    def stalled(self) -> str | None: ...  # why no step can run while requests wait, if so (then unhealthy)
    @property
    def spec_ended(self) -> SpecStats: ...
    def prefix_stats(self) -> tuple[PrefixStats, int]: ...  # prefix reuse so far, and the bytes kept now
    def kv_blocks(self) -> BlockCounts | None: ...  # a paged pool's blocks held, cached and free (None: keyed)
    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket: ...
    def cancel(self, ticket: Ticket) -> None: ...
    def speculating(self) -> dict[int, SpecStats]: ...
    def stop(self) -> None: ...
    def shutdown(self) -> None: ...  # stop, then close the pipelines


class Engine:
    def __init__(self, pipe: Pipeline, limits: Limits, max_context: int,
                 scheduling: SchedulerConfig | None = None, drafts: Drafts | None = None,
                 replays: Replays | None = None, role: Role | None = None, prefix: PrefixCache | None = None,
                 scheduler: Scheduler | None = None) -> None:
        """`role`: what this engine serves in disaggregated serving (disagg/: a prefill or a
        decode instance); None: coupled, every request prefills and decodes here. `prefix`:
        ended streams' KV kept and reused by later prompts (None: off). `scheduler`: a paged
        pipeline's (serving/paged_scheduler.py: its blocks, its prefix reuse), else a keyed one
        of `scheduling` and `prefix`."""
        self.pipe = pipe
        self.role: Role = role or Coupled()
        self.replays = replays or Replays()  # how often and how long a lost stream is replayed
        self.limits = limits
        self.max_context = max_context
        if scheduler is not None:  # the role says which streams leave, whichever the scheduler
            scheduler.handoffs = self.role.handoffs
        self.scheduler: Scheduler = scheduler or KeyedScheduler(scheduling, self.role.handoffs, prefix)
        self.spec = SpecDriver(drafts, self.scheduler, pipe)
        self._waiting: deque[Ticket] = deque()
        self._cancels: deque[Ticket] = deque()
        self._lock = threading.Lock()  # guards _waiting, _cancels and _taken (callers' threads)
        # Stream slots held: admitted and not yet finished. Counted under the lock from the
        # moment a ticket leaves the queue, so a ticket between the queue and the scheduler
        # still counts when a caller checks whether there is room.
        self._taken = 0
        self._observed: object = None  # the last step timing the scheduler was told of (rows share one)
        self._ids = count()  # requests (tickets)
        self._running = True
        self.role.bind(self)
        self.failed: str | None = None  # why the engine thread stopped, if it did (then unhealthy)
        # After the last round, for readers on any thread (the fleet page): decode groups with
        # members, and the KV slots the streams' own caches hold (a group pads to its longest).
        self.groups_live = 0
        self.kv_slots_live = 0
        self.kv_bytes_live: int | None = None  # a paged pool's: the bytes of the blocks held, every stage
        # Why the last round could run no step while streams wait (status.stall), if so: /health says it.
        self.stalled: str | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine")
        self._thread.start()
        trim_memory_every()  # streams come and go for as long as it runs

    # --- callers' side (any thread) ----------------------------------------------------------

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket:
        if not request.prompt:
            raise ShardlineError("the prompt is empty")
        if request.stops and request.detokenizer is None:
            raise ShardlineError("stop sequences need the request's detokenizer")
        need = len(request.prompt) + request.sampling.max_tokens
        if need > self.max_context:
            raise ShardlineError(f"prompt of {len(request.prompt)} tokens plus {request.sampling.max_tokens} "
                                 f"new tokens exceeds the context of {self.max_context}")
        with self._lock:
            if self.failed:
                raise EngineFailed(f"the engine has stopped: {self.failed}")
            if not accepts(len(self._waiting), self._taken, self.limits):
                raise Overloaded(f"all {self.limits.max_streams} streams are busy and "
                                 f"{len(self._waiting)} requests are waiting")
            ticket = Ticket(next(self._ids), request, on_event)
            self._waiting.append(ticket)
        self.pipe.wake()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for `ticket` and free its stream (e.g. the client went away)."""
        with self._lock:
            self._cancels.append(ticket)
        self.pipe.wake()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self.scheduler.streams)

    def speculating(self) -> dict[int, SpecStats]:
        """Running streams' speculation so far, by stream (read from any thread: a snapshot)."""
        return self.spec.running()

    @property
    def spec_ended(self) -> SpecStats:
        return self.spec.ended

    def prefix_stats(self) -> tuple[PrefixStats, int]:
        """Prefix reuse so far and the bytes its entries hold (any thread: a snapshot)."""
        return self.scheduler.kept()

    def kv_blocks(self) -> BlockCounts | None:
        """A paged pool's blocks by state now (any thread); None on the keyed runner."""
        return self.scheduler.block_counts()

    def prefix_covers(self, request: Request) -> int:
        """How many of `request`'s prompt tokens a kept prefix would save now (any thread: a
        reading that may be stale by the time the request starts; a front routes by it)."""
        return self.scheduler.covers(request.prompt, request.scope) if request.cache_prompt else 0

    def drop_prefixes(self) -> None:
        """After `stop`: every kept entry released on every stage, so that the pipeline, which
        goes on under another engine (an instance that changes role), holds none of them."""
        if self._thread.is_alive():
            raise ShardlineError("kept prefixes are dropped only once the engine has stopped")
        if released := self.scheduler.drop_kept():
            execute(self.pipe, Plan(tuple(released)), self._step_failed)

    def queued(self) -> list[Ticket]:
        """The waiting tickets, oldest first (any thread: a snapshot)."""
        with self._lock:
            return list(self._waiting)

    def streams(self) -> list[Stream]:
        """The running streams (read from any thread: a snapshot)."""
        for _ in range(10):  # the engine thread may add or remove a stream while this reads
            try:
                return list(self.scheduler.streams.values())
            except RuntimeError:
                continue
        return []

    def stop(self) -> None:
        self._running = False
        self.pipe.wake()
        self._thread.join(timeout=10)

    def shutdown(self) -> None:
        self.stop()
        self.pipe.shutdown()

    # --- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._running:
                self.step()
            self._fail_all("cancelled", "")
        except BaseException as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("the engine thread stopped")
            with self._lock:
                self.failed = f"{type(e).__name__}: {e}"
            self._fail_all("error", f"the engine stopped: {self.failed}")

    def step(self) -> None:
        """One round of the engine thread: apply the outcomes that came back (waiting for them
        only when nothing else can be done), take the callers' messages (cancels, then new and
        arriving streams), then plan and execute the round."""
        drew = self.spec.draft_ahead()  # this machine is idle while every step is out on workers
        for outcome in self.pipe.outcomes(timeout=0.0 if drew else 1.0):
            self._moved(outcome.item) if isinstance(outcome, Moved) else self._apply(outcome)
        self._apply_cancels()
        self.role.tend()  # a role's own queue: streams arriving
        self._admit()
        self.spec.draft()  # drafts before planning: the plan places them in the rows
        self._dispatch()

    def _dispatch(self) -> None:
        plan = self.scheduler.plan(self.spec.proposals())
        self.groups_live = sum(1 for g in self.scheduler.groups if g.members())
        self.kv_slots_live = self.scheduler.kv.slots()
        blocks = self.kv_blocks()
        if blocks is not None:
            self.kv_bytes_live = self.scheduler.held_bytes()
        self.stalled = stall(plan, list(self.scheduler.streams.values()), blocks)
        for step in plan.steps:
            if isinstance(step, DecodeStep | RaggedStep):
                self.spec.launched(step)
        execute(self.pipe, plan, self._step_failed)
        if left := self.scheduler.take_left():
            self.role.left(left)

    def _step_failed(self, step: AnyStep, why: str) -> None:
        for s in step.streams:
            stream = self.scheduler.streams.get(s)
            if stream is not None:
                stream.in_flight = False
                self._finish(stream, "error", why)

    def _admit(self) -> None:
        """Waiting requests start as streams while there are slots, in the role's order."""
        with self._lock:
            n = to_admit(len(self._waiting), self._taken, self.limits)
            starting = self.role.order(self._waiting, n)
            self._taken += n
        for ticket in starting:
            if ticket.cancelled:
                self.release_slot()
                ticket.on_event(Event(None, finish="cancelled"))
                continue
            r = ticket.request
            ticket.text = StopText(r.detokenizer(), r.stops) if r.detokenizer else None
            # A request without a seed gets one now: its tokens then depend on nothing else.
            params = r.sampling.params(secrets.randbits(63))
            lease = self._lease()
            ticket.stream = Stream(new_stream_id(), list(r.prompt), params, r.sampling.max_tokens, r.stop_ids,
                                   r.sampling.want_logits, owner=ticket, book=self.scheduler.kv.book(lease), key=lease,
                                   prefix_scope=r.scope if r.cache_prompt else None, constraint=r.constraint)
            if r.speculative:
                ticket.stream.spec = self.spec.speculation()
            self.scheduler.add(ticket.stream)

    def _lease(self) -> Lease:
        return self.scheduler.kv.lease()

    def _apply_cancels(self) -> None:
        with self._lock:
            tickets, self._cancels = list(self._cancels), deque()
        for ticket in tickets:
            ticket.cancelled = True  # a waiting ticket is dropped when its turn comes
            stream = ticket.stream
            if stream is not None and stream.id in self.scheduler.streams and not stream.in_flight:
                self._finish(stream, "cancelled")

    def _moved(self, item: KvMove) -> None:
        """A KV move landed: whoever asked for it takes it now (the scheduler's prefix reuse a
        copy, the role an export or an import)."""
        self.scheduler.moved(item)
        self.role.moved(item)

    def _apply(self, outcome: Outcome) -> None:
        stream = self.scheduler.streams.get(outcome.stream)
        if stream is None:
            return
        stream.in_flight = False
        if outcome.timing is not None and outcome.timing is not self._observed:
            self._observed = outcome.timing
            self.scheduler.observe(stream, outcome.timing)
        try:
            if outcome.lost:
                return self._lost(stream, outcome.error)
            if outcome.failed:
                return self._finish(stream, "error", outcome.error)
            stream.lost_at = None  # it runs again: a later loss is a new repair
            if stream.constraint is not None and stream.constraint.failure is not None:
                return self._grammar_failed(stream, stream.constraint)
            if outcome.hidden is not None:  # a summarizing pipeline's (a prefill instance's)
                stream.handover.saw(outcome.hidden)
            stood = self.spec.verified(stream, outcome)
            self.spec.settled(stream, len(stood))
            for choice in stood:
                if choice.failed >= 0:  # this stream's entry alone: the step's others went on
                    return self._finish(stream, "error", f"no token could be chosen: {choice.why}")
                if self._emit(stream, choice):
                    return
            if ticket_of(stream).cancelled:
                return self._finish(stream, "cancelled")
        except Exception as e:  # noqa: BLE001 - a bug in one stream's handling fails it alone
            log.exception("stream %d failed", stream.id)
            if stream.id in self.scheduler.streams:
                self._finish(stream, "error", f"internal error: {type(e).__name__}: {e}")

    def _lost(self, stream: Stream, why: str) -> None:
        """The pipeline broke under `stream`: replay it (a new lease; its old one released), or
        end it with why not."""
        if ticket_of(stream).cancelled:
            return self._finish(stream, "cancelled")
        now = time.monotonic()
        stream.lost_at = now if stream.lost_at is None else stream.lost_at
        if (no := refusal(self.replays, stream.replays, now - stream.lost_at, why)) is not None:
            return self._finish(stream, "error", no)
        old = stream.key
        self.scheduler.replay(stream, self._lease())
        log.warning("stream %d replayed on lease %d (was %d) after %d tokens: %s", stream.id, stream.key, old,
                    len(stream.generated), why)

    def _emit(self, stream: Stream, choice: Choice) -> bool:
        """Deliver one chosen token; True once the stream has ended."""
        ticket = ticket_of(stream)
        if ticket.cancelled:
            self._finish(stream, "cancelled")
            return True
        if choice.token in stream.stop_ids or self._grammar_ends(stream, choice.token):
            self._finish(stream, "stop")
            return True
        if stream.constraint is not None and not self._grammar_takes(stream, stream.constraint, choice.token):
            return True
        stream.generated.append(choice.token)
        text, offset = ticket.text.push(choice.token) if ticket.text else ("", 0)
        cut = bool(ticket.text and ticket.text.stopped)
        ticket.on_event(Event(choice.token, choice.logprob, top=choice.top, text=text, offset=offset, cut=cut))
        if cut:  # a stop sequence: ends here, as a stop token does
            self._finish(stream, "stop")
            return True
        if ticket.cancelled:  # the callback may cancel
            self._finish(stream, "cancelled")
            return True
        if stream.done:
            self._finish(stream, "length")
            return True
        return False

    def _grammar_ends(self, stream: Stream, token: int) -> bool:
        try:
            return stream.constraint is not None and stream.constraint.ends(token)
        except Exception:  # noqa: BLE001 - the next call, to advance it, says why
            return False

    def _grammar_takes(self, stream: Stream, constraint: Constraint, token: int) -> bool:
        """Advance `stream`'s grammar by its `token`; False once it could not (the stream has
        ended with the reason: its request's own grammar failed, nobody else's)."""
        try:
            constraint.advance(token)
            return True
        except Exception as e:  # noqa: BLE001 - whatever the grammar engine raises is this stream's alone
            constraint.failure = brief(e)
            self._grammar_failed(stream, constraint)
            return False

    def _grammar_failed(self, stream: Stream, constraint: Constraint) -> None:
        log.info("stream %d: its grammar, %s, cannot go on: %s", stream.id, constraint.label, constraint.failure)
        self._finish(stream, "error", constraint.failure or "", cause="constraint")

    def take_slot(self, fits: Callable[[], bool]) -> bool:
        """Hold a stream slot for a request that does not come through the queue (a decode
        instance's arrival) if one is free and `fits()` (checked under the lock)."""
        with self._lock:
            if self._taken >= self.limits.max_streams or not fits():
                return False
            self._taken += 1
            return True

    def release_slot(self) -> None:
        with self._lock:
            self._taken -= 1

    def _finish(self, stream: Stream, reason: str, error: str = "", cause: str = "") -> None:
        self.scheduler.remove(stream, keep=reason in ("stop", "length"))
        stats = self.spec.closed(stream)
        self.release_slot()
        ticket = ticket_of(stream)
        text = ticket.text.flush() if ticket.text and reason in ("stop", "length") else ""
        ticket.on_event(Event(None, finish=reason, error=error, spec=stats, text=text, cause=cause))

    def _fail_all(self, reason: str, error: str) -> None:
        """Every admitted and waiting request ends (the loop stopped); keys are released. Each
        step is guarded: this runs after a failure, and must reach every caller."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        def guarded(end: Callable[..., None], *args: object) -> None:
            try:
                end(*args)
            except Exception:  # noqa: BLE001 - logged; the others must still be told
                log.exception("while ending a request")

        final = Event(None, finish=reason, error=error)
        for ticket in [*waiting, *self.role.drop()]:
            guarded(ticket.on_event, final)
        for stream in list(self.scheduler.streams.values()):
            stream.in_flight = False
            guarded(self._finish, stream, reason, error)
        for key in self.scheduler.releases():
            guarded(self.pipe.release, key)

    def empty(self) -> bool:
        """No request here: none waiting, running or held by the role (any thread; a flip checks it)."""
        return self.role.empty() and self.active == 0 and self.waiting == 0
