"""The watchdog's deadline as a function of measured step times, without processes or clocks."""

from __future__ import annotations

import pytest

from shardline.errors import ShardlineError
from shardline.pipeline.deadline import Deadlines, StepClock
from shardline.wire.messages import Phase

DECODE, PREFILL = Phase.DECODE, Phase.PREFILL


def test_before_any_answer_the_floor_is_the_deadline() -> None:
    clock = StepClock(Deadlines(floor_s=2.0, multiple=10))
    assert clock.allowed(DECODE) == clock.allowed(PREFILL) == 2.0
    assert clock.late(DECODE, sent_at=100.0, now=101.9) is None
    assert clock.late(DECODE, sent_at=100.0, now=102.1) == 2.0


def test_the_deadline_follows_each_phase_average_above_the_floor() -> None:
    clock = StepClock(Deadlines(floor_s=1.0, multiple=10))
    clock.answered(PREFILL, sent_at=0.0, now=0.5)  # the first step sets the average
    assert clock.allowed(PREFILL) == 5.0 and clock.allowed(DECODE) == 1.0  # decode: none measured yet
    clock.answered(PREFILL, sent_at=1.0, now=2.0)  # running: 0.8 x 0.5 + 0.2 x 1.0
    assert clock.average[PREFILL] == pytest.approx(0.6)
    assert clock.allowed(PREFILL) == pytest.approx(6.0)
    for i in range(50):  # fast decode steps: the floor holds, never a fraction of a second
        clock.answered(DECODE, sent_at=10.0 + i, now=10.02 + i)
    assert clock.allowed(DECODE) == 1.0


def test_a_step_queued_behind_others_is_timed_from_the_last_answer() -> None:
    clock = StepClock(Deadlines(floor_s=1.0, multiple=2))
    clock.answered(DECODE, sent_at=0.0, now=5.0)  # one slow step: average 5 s
    assert clock.allowed(DECODE) == 10.0
    # sent at 3, but the workers were busy with the step before until 5: waited 6 s, not 8
    assert clock.waited(sent_at=3.0, now=11.0) == 6.0
    assert clock.late(DECODE, sent_at=3.0, now=14.0) is None
    assert clock.late(DECODE, sent_at=3.0, now=15.5) == 10.0
    clock.answered(DECODE, sent_at=3.0, now=6.0)  # measured the same way: 1 s of its own
    assert clock.average[DECODE] == pytest.approx(0.8 * 5.0 + 0.2 * 1.0)


def test_a_refusal_moves_the_clock_but_not_the_averages() -> None:
    clock = StepClock(Deadlines(floor_s=1.0, multiple=10))
    clock.answered(DECODE, sent_at=0.0, now=0.3)
    clock.answered(DECODE, sent_at=0.0, now=4.0, timed=False)
    assert clock.average == {DECODE: 0.3} and clock.last_answer == 4.0
    assert clock.waited(sent_at=1.0, now=4.5) == 0.5


@pytest.mark.parametrize(("floor", "multiple"), [(0.0, 10.0), (-1.0, 10.0), (1.0, 0.5), (float("nan"), 2.0)])
def test_bad_limits_are_refused(floor: float, multiple: float) -> None:
    with pytest.raises(ShardlineError, match="a step deadline needs a floor > 0 s and a multiple >= 1"):
        Deadlines(floor, multiple)


def test_a_step_expected_to_take_long_gets_a_multiple_of_that() -> None:
    """A first 8B-class prompt chunk: stage 0 took 5 s here, three worker stages follow. With no
    average yet and a 10 s floor it would be lost at 10 s; it is allowed 20 x 15 s."""
    clock = StepClock(Deadlines(floor_s=10.0, multiple=20.0))
    assert clock.late(PREFILL, sent_at=0.0, now=11.0) == 10.0
    assert clock.late(PREFILL, sent_at=0.0, now=11.0, expected_s=15.0) is None
    assert clock.late(PREFILL, sent_at=0.0, now=301.0, expected_s=15.0) == 300.0
    assert clock.late(DECODE, sent_at=0.0, now=11.0, expected_s=0.1) == 10.0  # the floor still rules short steps
