"""A decode group emptied by a stream that ends, and re-entered in the same engine round by a
stream that just got its first token: the group's key must be released before the joiner's merge
reaches the pipeline, not after it (it then freed the joiner's new state; seen on a decode
instance as "unknown key -1" one step later)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from shardline.config import SamplingConfig
from shardline.pipeline.plan import DecodeStep, Outcome, PrefillStep, Step
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from tests.unit.test_engine_replay import FakeChain


class GatedChain(FakeChain):
    """FakeChain that answers nothing until both prompts' first chunks are in, so the rounds line
    up whatever the threads' timing: round 1 both first chunks; round 2 the short prompt's first
    decode step (it opens group -1) and the long prompt's last chunk; round 3 the short stream's
    last token (it leaves the group empty) and the long one's first (it joins the group)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []  # what reached the pipeline, in order: (kind, key)
        self._firsts = 0
        self._both_in = threading.Event()

    def submit(self, step: Step) -> None:
        kind = "merge" if isinstance(step, DecodeStep) and step.merge else type(step).__name__
        self.log.append((kind, step.key))
        super().submit(step)
        self._firsts += isinstance(step, PrefillStep) and step.first
        if self._firsts == 2:
            self._both_in.set()

    def release(self, key: int) -> None:
        self.log.append(("release", key))
        super().release(key)

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        if not self._both_in.wait(timeout):
            return []
        return super().outcomes(timeout)


def test_a_group_emptied_and_joined_in_one_round_keeps_the_joiners_state() -> None:
    chain = GatedChain()
    engine = Engine(chain, Limits(4, 4), 4096, SchedulerConfig(chunk=4, groups=1, max_prefills=2))
    finals: list[Event] = []
    tokens: list[list[int]] = [[], []]
    done = threading.Semaphore(0)

    def on(i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            if ev.token is not None:
                tokens[i].append(ev.token)
            if ev.finish:
                finals.append(ev)
                done.release()
        return event

    try:
        engine.submit(Request([5, 6, 7], SamplingConfig(max_tokens=2), frozenset()), on(0))
        engine.submit(Request([12, 13, 14, 15, 16, 17, 18], SamplingConfig(max_tokens=6), frozenset()), on(1))
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
    finally:
        engine.stop()
    assert [f.finish for f in finals] == ["length", "length"], finals
    assert [len(t) for t in tokens] == [2, 6]
    # The joiner's merge into -1 comes after -1 was released, and -1 is not released again
    # until the joiner has left it.
    merges = [i for i, (kind, key) in enumerate(chain.log) if kind == "merge" and key == -1]
    assert len(merges) == 2, chain.log
    released = [i for i, (kind, key) in enumerate(chain.log) if kind == "release" and key == -1]
    assert merges[0] < released[0] < merges[1] < released[1], chain.log
    assert chain.state == {}
