"""The engine's speculation, on the engine thread: drafts before a decode step is planned,
drafts drawn ahead while every step is out on remote stages, each decode group's veto, the
verify rule applied to an outcome, and measured step costs for each stream's choice of K.

Invariants:
- A stream offers drafts only when it is about to decode (idle) and its group allows them (a
  fixed K is the user's choice and stands).
- `costs` holds measured decode steps by their number of rows: a step's base cost grows with
  its rows, and K is chosen against the cost of the step it will ride in.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shardline.decoding.drafts import Proposal
from shardline.decoding.sampler import Choice
from shardline.pipeline.plan import DecodeStep, Outcome, Pipeline
from shardline.pipeline.ragged_step import RaggedStep
from shardline.serving.constrained import within_grammar
from shardline.serving.scheduler import Scheduler

if TYPE_CHECKING:
    from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.speculation import Drafts, SpecStats, Speculation, StepCost
from shardline.serving.stream import Stream

log = logging.getLogger("shardline.engine")


class SpecDriver:
    def __init__(self, drafts: Drafts | None, scheduler: Scheduler | PagedScheduler, pipe: Pipeline) -> None:
        self.drafts = drafts  # where speculating streams' drafts come from (None: no speculation)
        self.scheduler = scheduler
        self.pipe = pipe
        self.costs: dict[int, StepCost] = {}
        self.ended = SpecStats(0, 0, 0, 0)  # the sums over streams that ended (k unused)

    def speculation(self) -> Speculation | None:
        """A new stream's speculation (None when the engine does not speculate)."""
        return self.drafts.speculation() if self.drafts is not None else None

    def draft(self) -> None:
        """Drafts for each speculating stream about to decode (graph work of the draft model, if
        any, runs here: it is small, and its proposal must exist before the step is planned)."""
        for s in self.scheduler.streams.values():
            spec = s.spec
            if spec is None or spec.planned or not s.idle_decoder():
                continue
            if not self._group_drafts(s.id, spec):
                spec.hold()
                continue
            try:
                rows = self._rows(s)
                cost = self.costs.setdefault(rows, StepCost(rows=rows))
                context = s.prompt + s.generated
                k = spec.choose_k(cost, rows, room=s.max_tokens - len(s.generated) - 1,
                                  ready=spec.drafter.ready(context))
                spec.offer(within_grammar(s.constraint, spec.drafter.propose(context, k, s.params)) if k
                           else Proposal([]))
            except Exception as e:  # noqa: BLE001 - a drafter's failure costs its stream the drafts only
                log.warning("stream %d: no drafts (%s: %s)", s.id, type(e).__name__, e)
                spec.offer(Proposal([]))

    def draft_ahead(self) -> bool:
        """While every step is out on remote stages, this machine is idle: each speculating
        stream whose decode step is out lets its drafter catch up with the text or draw one
        more draft past it (drafts/ModelDrafter.follow), where drafts could pay at all.
        Whether any drafter ran (then outcomes are polled, not waited for)."""
        if not self.pipe.idle():
            return False
        drew = False
        for s in self.scheduler.streams.values():
            spec = s.spec
            if spec is None or not s.in_flight or not s.decoding:
                continue
            rows = self._rows(s)
            if not self._group_drafts(s.id, spec) or not spec.worth_following(self.costs.get(rows), rows):
                continue
            try:
                drew = spec.drafter.follow(s.prompt + s.generated, s.params, spec.ahead_limit()) or drew
            except Exception as e:  # noqa: BLE001 - drafts drawn ahead are an optimization only
                log.warning("stream %d: no drafts ahead (%s: %s)", s.id, type(e).__name__, e)
        return drew

    def proposals(self) -> dict[int, Proposal]:
        """The drafts each speculating stream offers its next step, by stream (the scheduler
        places them in the rows; the outcome is verified against them)."""
        return {s.id: s.spec.proposal for s in self.scheduler.streams.values() if s.spec and s.spec.planned}

    def launched(self, step: DecodeStep | RaggedStep) -> None:
        """`step` is about to be submitted: when it left (its time, for K) and its group's pace.
        A ragged step's decoding streams each time it as one row of its width (no groups)."""
        if isinstance(step, RaggedStep):
            now = time.perf_counter()
            for q, sid in enumerate(step.streams):
                s = self.scheduler.streams[sid]
                if s.spec is not None and not s.prefilling:
                    s.sent = (now, 1, int(step.batch.begins[q + 1] - step.batch.begins[q]))
            return
        self.scheduler.streams[step.streams[0]].sent = (time.perf_counter(), step.inputs.rows, step.inputs.new_tokens)
        group = self.scheduler.groups.by_key(step.key)
        if group is not None:
            streams = [self.scheduler.streams[s] for s in step.streams]
            group.pace.launched(len(streams), any(s.spec and s.spec.proposal.tokens for s in streams),
                                steady=not step.merge)

    def settled(self, stream: Stream, tokens: int) -> None:
        group = self.scheduler.groups.group_of(stream.id)
        if group is not None:
            group.pace.settled(tokens, time.perf_counter(), len(group.members()))

    def verified(self, stream: Stream, outcome: Outcome) -> tuple[Choice, ...]:
        """The choices that stand: all of a plain step's; of a verify step, the target's choices
        up to and including the first that differs from the draft offered (the drafts after it
        are masked out of the cache, and the logical position steps back over them)."""
        self._timed(stream)
        spec = stream.spec
        if spec is None or not spec.planned:
            return outcome.choices
        offered = len(spec.proposal.tokens)
        kept = spec.settle([c.token for c in outcome.choices], time.perf_counter())
        if stream.blocks is None:  # a paged stream's rejected drafts go with its past (paged_scheduler.py)
            stream.book.mask_last(offered - kept)
        return outcome.choices[: kept + 1]

    def closed(self, stream: Stream) -> SpecStats | None:
        """`stream` ended: its drafter closed, its figures added to the sums; its own figures."""
        if stream.spec is None:
            return None
        stream.spec.drafter.close()
        stats = stream.spec.stats()
        self.ended = self.ended + stats
        return stats

    def running(self) -> dict[int, SpecStats]:
        """Running streams' speculation so far, by stream (read from any thread: a snapshot)."""
        for _ in range(10):  # the engine thread may add or remove a stream while this reads
            try:
                return {s.id: s.spec.stats() for s in list(self.scheduler.streams.values()) if s.spec}
            except RuntimeError:
                continue
        return {}

    def _rows(self, s: Stream) -> int:
        return len(self.scheduler.groups.members_of(s.id)) or 1

    def _group_drafts(self, stream: int, spec: Speculation) -> bool:
        """Whether `stream`'s decode group lets its rows offer drafts (GroupPace)."""
        group = self.scheduler.groups.group_of(stream)
        return group is None or group.pace.allow or spec.fixed_k is not None

    def _timed(self, stream: Stream) -> None:
        """A decode step of `stream` (its group's first row) came back: its time, for K."""
        if stream.sent is not None:
            when, rows, width = stream.sent
            self.costs.setdefault(rows, StepCost(rows=rows)).record(time.perf_counter() - when, rows, width)
            stream.sent = None
