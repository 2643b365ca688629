"""Issue 54 point 1 in the engine alone: an entry the last stage could not sample (a failed
Choice: its logits were not finite, its mask allowed nothing) ends its own stream with the reason,
and the streams beside it in the same decode group go on with their own tokens. Over FakeChain
(tests/unit/test_engine_replay.py), whose tokens are a pure function of the text so far."""

from __future__ import annotations

import threading

from shardline.config import SamplingConfig
from shardline.decoding.sampler import Choice
from shardline.pipeline.plan import Step
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from tests.unit.test_engine_replay import FakeChain

POISON = 999  # a prompt starting with it gets a failed entry once it has 3 tokens of its own
PROMPTS = [[5, 6, 7], [8, 9], [POISON, 1, 2], [3, 4, 5, 6]]


class Unsampleable(FakeChain):
    def _run(self, step: Step) -> list[tuple[Choice, int]]:
        out = super()._run(step)
        rows = self.state[step.key]
        return [(Choice(-1, 0.0, failed=0) if rows[r][0] == POISON and len(rows[r]) >= 6 else c, r) for c, r in out]


def _serve(pipe: FakeChain, prompts: list[list[int]]) -> list[list[Event]]:
    engine = Engine(pipe, Limits(4, 4), 4096, SchedulerConfig(chunk=4, groups=1))
    events: list[list[Event]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on(i: int) -> object:
        def deliver(ev: Event) -> None:
            events[i].append(ev)
            if ev.finish:
                done[i].set()
        return deliver

    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(p, SamplingConfig(max_tokens=8), frozenset()), on(i))  # type: ignore[arg-type]
        assert all(d.wait(10) for d in done)
    finally:
        engine.stop()
    return events


def test_an_unsampleable_entry_ends_its_stream_alone() -> None:
    plain = [p for p in PROMPTS if p[0] != POISON]
    want = _serve(FakeChain(), plain)
    got = _serve(Unsampleable(), PROMPTS)
    assert [[e.token for e in evs] for evs in got if evs[-1].finish != "error"] == [[e.token for e in w] for w in want]
    [poisoned] = [evs for evs in got if evs[-1].finish == "error"]
    assert poisoned[-1].error == "no token could be chosen: the logits are not finite" and poisoned[-1].cause == ""
    assert 0 < len(poisoned) - 1 < 8  # the tokens before the failed entry reached its caller
