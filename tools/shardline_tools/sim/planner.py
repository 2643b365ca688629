"""A simulated instance plans with the real scheduler (serving/scheduler.py, pure): its requests
are real Streams (their token ids do not matter, only lengths and KV books), each plan's steps
are charged by `Costs` from their shapes, and their outcomes applied at the step's end. So the
simulator runs the engine's own decisions (decode groups, joins and leaves, compaction, prompt
chunks), not a copy of them.

How a step is charged (simulator.py: the time model):
- a prefill chunk of n positions after c cached: `prefill_s(n, c)`;
- a decode step of R rows whose state is w slots wide (the token fed now included):
  `decode_s(R, w)`, plus `merge_s(R, w)` when it merges joiners into kept rows (or more than one
  joiner into an empty group; a first joiner alone takes its own state over, no copy), or
  `drop_s(R, w)` when it drops departed rows; a step that compacts pays `drop_s(R, w)` over the
  state as it was and then decodes over the compacted width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shardline.config import SamplingParams
from shardline.pipeline.plan import DecodeStep, PrefillStep, StreamId
from shardline.pipeline.plan import Step as PlannedStep
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.stream import Stream
from shardline_tools.sim.costs import Costs

GREEDY = SamplingParams()
TOKEN = 0  # what every simulated token reads as: only lengths matter

Finish = Callable[[float], None]  # a step's effect, applied at its end time
Step = Callable[[], tuple[float, Finish]]  # called when the step starts: its seconds and its effect


class Request(Protocol):
    """What the planner needs of a simulated request (simulator.Req)."""

    prefilled: int

    @property
    def prompt(self) -> int: ...

    def first_token(self, t: float) -> bool: ...
    def advance(self, t: float) -> bool: ...


@dataclass
class Hooks:
    """What the instance does with its requests' progress: `prefilled(r)` after a first token
    that did not end `r`; `ended(r)` once `r` has its last token; `after()` once a step's effect
    is applied (memory accounting, admission)."""

    prefilled: Callable[[Request], None]
    ended: Callable[[Request], None]
    after: Callable[[], None]


class Planner:
    def __init__(self, costs: Costs, cfg: SchedulerConfig, hooks: Hooks) -> None:
        self.costs, self.hooks = costs, hooks
        self.scheduler = KeyedScheduler(cfg)
        self._reqs: dict[int, Request] = {}

    def add(self, key: int, r: Request, max_tokens: int) -> None:
        """A request admitted to prefill its prompt here."""
        self._reqs[key] = r
        self.scheduler.add(Stream(StreamId(key), [TOKEN] * r.prompt, GREEDY, max_tokens))

    def adopt(self, key: int, r: Request, max_tokens: int, generated: int) -> None:
        """A request prefilled elsewhere: its prompt's KV lands here with the tokens it has
        generated (the last of them fed by its next decode step), as a decode instance imports it."""
        self._reqs[key] = r
        stream = Stream(StreamId(key), [TOKEN] * r.prompt, GREEDY, max_tokens, prefilled=r.prompt,
                        generated=[TOKEN] * generated)
        stream.book.commit(stream.book.plan([TOKEN] * (r.prompt + generated - 1)))
        self.scheduler.add(stream)

    def plan(self) -> list[Step]:
        """The next round's steps, in the order the engine submits them."""
        steps = self.scheduler.plan().steps
        assert all(isinstance(s, PlannedStep) for s in steps)  # the keyed scheduler plans no ragged steps
        return [self._charged(step) for step in steps if isinstance(step, PlannedStep)]

    def _charged(self, step: PlannedStep) -> Step:
        def start() -> tuple[float, Finish]:
            seconds = self._seconds(step)

            def finish(t: float) -> None:
                for row, key in enumerate(step.streams):
                    self._outcome(key, step, step.entries(row), t)
                self.hooks.after()

            return seconds, finish

        return start

    def _seconds(self, step: PlannedStep) -> float:
        c = self.costs
        inputs = step.inputs
        if isinstance(step, PrefillStep):
            return c.prefill_s(inputs.new_tokens, int(inputs.position_ids[0, 0]))
        assert isinstance(step, DecodeStep)
        rows, width = inputs.rows, int(inputs.attention_mask.shape[1])
        regroup = 0.0
        if step.merge:
            regroup = c.merge_s(rows, width) if step.keep or len(step.merge) > 1 else 0.0
        elif step.keep or inputs.beam_idx is not None:
            regroup = c.drop_s(rows, width)
        elif step.compact:
            regroup = c.drop_s(rows, width)
            width = int(inputs.compacted()[1].attention_mask.shape[1])
        return regroup + c.decode_s(rows, width)

    def _outcome(self, key: int, step: PlannedStep, entries: int, t: float) -> None:
        """What the engine applies for one row: the prompt chunk counted, then its token(s)."""
        stream, r = self.scheduler.streams[key], self._reqs[key]
        stream.in_flight = False
        if isinstance(step, PrefillStep):
            r.prefilled += step.inputs.new_tokens
            if not entries:
                return
            stream.generated.append(TOKEN)
            if not r.first_token(t):
                return self.hooks.prefilled(r)
        else:
            stream.generated.append(TOKEN)
            if not r.advance(t):
                return
        self.scheduler.remove(stream)
        del self._reqs[key]
        self.hooks.ended(r)
