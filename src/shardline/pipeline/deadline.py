"""When a step is overdue. A worker that stops answering (hung, stopped, its machine asleep)
breaks no link: only time shows it. Pure: every time is passed in (monotonic seconds).

Answers come back in the order steps were sent (each worker runs its steps in arrival order and
every hop is one TCP stream), so only the oldest step in flight can be late. It is measured from
when it was sent or from the last answer, whichever is later: a step queued behind others is
not charged for their time. Its allowance is the larger of a floor and a multiple of the running
average of recent steps of its phase, measured the same way (a prefill chunk takes far longer
than a decode step; the floor covers the first steps, before any average, and short steps'
jitter). A step may also bring its own expectation: the coordinator has just run stage 0 on it,
and the workers run the other stages of the same model, so a step whose stage 0 took 5 s (a
128-token prompt chunk of an 8B model on two cores) is not declared lost after a 10 s floor
because no step of its size was seen before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.errors import ShardlineError
from shardline.wire.messages import Phase

WEIGHT = 0.2  # of the newest step in the running average


@dataclass(frozen=True)
class Deadlines:
    floor_s: float = 10.0  # no step is declared lost sooner
    multiple: float = 20.0  # of its phase's running average

    def __post_init__(self) -> None:
        if not self.floor_s > 0 or not self.multiple >= 1:
            raise ShardlineError(f"a step deadline needs a floor > 0 s and a multiple >= 1, "
                                 f"got {self.floor_s} s and {self.multiple}")


@dataclass
class StepClock:
    limits: Deadlines
    last_answer: float = float("-inf")  # when the workers last answered any step
    average: dict[Phase, float] = field(default_factory=dict)  # seconds per step, by phase

    def allowed(self, phase: Phase) -> float:
        return max(self.limits.floor_s, self.limits.multiple * self.average.get(phase, 0.0))

    def waited(self, sent_at: float, now: float) -> float:
        """How long the oldest step in flight, sent at `sent_at`, has been the one awaited."""
        return now - max(sent_at, self.last_answer)

    def late(self, phase: Phase, sent_at: float, now: float, expected_s: float = 0.0) -> float | None:
        """The allowance the oldest step in flight has overrun (None: it is not late); at least
        `multiple` x `expected_s`, what the step itself is expected to take on the workers."""
        allowed = max(self.allowed(phase), self.limits.multiple * expected_s)
        return allowed if self.waited(sent_at, now) > allowed else None

    def answered(self, phase: Phase, sent_at: float, now: float, timed: bool = True) -> None:
        """A step sent at `sent_at` was answered at `now`; `timed`: its time joins its phase's
        average (a refusal is quick and says nothing of how long steps take)."""
        if timed:
            took = self.waited(sent_at, now)
            old = self.average.get(phase)
            self.average[phase] = took if old is None else (1 - WEIGHT) * old + WEIGHT * took
        self.last_answer = max(self.last_answer, now)
