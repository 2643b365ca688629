"""The engine stops a decode group's drafts when they cost the group more than they give, though
the row that drafts gains: over a fake pipeline whose steps take time by their width. The time is
a fake clock the engine reads (steps and proposals advance it), so no verdict depends on how
busy the machine running the test is."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from shardline.config import SamplingConfig, SamplingParams
from shardline.decoding.drafts import Drafter, Proposal
from shardline.decoding.sampler import Choice
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.plan import DecodeStep, Outcome, Step
from shardline.serving import engine as engine_module
from shardline.serving import engine_spec
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import PROBE_EVERY, Drafts

BASE_S, PER_POSITION_S = 0.010, 0.001  # a step: 10 ms, plus 1 ms per extra position of its widest row
HIDDEN_S = 0.025  # what a proposal really costs (a drafter taking the cores the stages need)


class Clock:
    """What the engine reads as `time`: only steps and proposals (on the engine thread) move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


CLOCK = Clock()


def _next(position: int) -> int:
    """The fake target's choice after `position`: it depends on the position only."""
    return 100 + position % 50


class TimedChain:
    """Steps run at once on submit, taking BASE_S + PER_POSITION_S x (width - 1); the decode
    steps seen: (rows, whether any row offered drafts)."""

    n_stages = 2
    context = 4096

    def __init__(self) -> None:
        self.outbox = Outbox()
        self.decodes: list[tuple[int, bool]] = []

    def submit(self, step: Step) -> None:
        width = step.inputs.input_ids.shape[1]
        if isinstance(step, DecodeStep):
            self.decodes.append((step.inputs.rows, width > 1))
            CLOCK.advance(BASE_S + PER_POSITION_S * (width - 1))
        pos = step.inputs.position_ids
        for r, s in enumerate(step.streams):
            self.outbox.put(Outcome(s, tuple(Choice(_next(int(pos[r, t])), 0.0)
                                             for row, t in step.sample_at.tolist() if row == r)))

    def release(self, key: int) -> None:
        pass

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class Oracle:
    """Knows the target's next tokens (every draft stands) and says drafting costs nothing, but
    takes HIDDEN_S to propose."""

    cost_s = 0.0

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        CLOCK.advance(HIDDEN_S)
        return Proposal([_next(len(context) - 1 + i) for i in range(k)])

    def ready(self, context: list[int]) -> int:
        return 0

    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool:
        return False

    def close(self) -> None: ...


class Silent(Oracle):
    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        return Proposal([])


def _drafters() -> Callable[[], Drafter]:
    made = iter([Oracle(), Silent(), Silent(), Silent()])
    return lambda: next(made)


def test_a_group_whose_drafting_row_slows_the_others_stops_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 rows, only the first drafts, and all its drafts stand. With 4 drafts a step takes 25 +
    14 ms for 5 of its tokens (128/s against 100/s without), so its own pace says draft; the
    group gets 5 + 3 tokens in 39 ms against 4 in 10 ms without: the group's pace says no, and it
    drafts only at its probes (the answers are the target's either way)."""
    monkeypatch.setattr(engine_module, "time", CLOCK)
    monkeypatch.setattr(engine_spec, "time", CLOCK)
    pipe = TimedChain()
    engine = Engine(pipe, Limits(4, 4), 4096, SchedulerConfig(chunk=16, groups=1),
                    Drafts(_drafters(), None, 4))
    events: list[list[Event]] = [[] for _ in range(4)]
    done = threading.Semaphore(0)

    def on(i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            events[i].append(ev)
            if ev.finish:
                done.release()
        return event

    prompts = [[1, 2, 3, 4 + i] for i in range(4)]
    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(p, SamplingConfig(max_tokens=600), frozenset()), on(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    for p, evs in zip(prompts, events, strict=True):
        assert evs[-1].finish == "length"
        assert [e.token for e in evs if e.token is not None] == [_next(len(p) - 1 + i) for i in range(600)]
    full = [drafted for rows, drafted in pipe.decodes if rows == 4]
    late = full[3 * PROBE_EVERY:]
    assert len(late) > 4 * PROBE_EVERY, len(full)
    assert sum(late) <= len(late) / PROBE_EVERY + 2, (sum(late), len(late))
