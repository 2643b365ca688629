"""A stream's speculation: its drafter, the drafts in flight, its acceptance, and how many
drafts to offer next (K).

A verify step feeds [last token, d1..dk] and the last stage chooses a token after each of the
k+1 positions. The leading drafts equal to the target's choices stand, plus the target's own
next token: 1 to k+1 tokens per step. The slots of the rejected drafts stay in every stage's
cache, masked for ever (KVBook.mask_last); the coordinator alone knows (workers just see masks).

K: with acceptance rate a (each draft stands with probability a, given the one before did), a
step offering k drafts yields E(k) = 1 + a + ... + a^k tokens and costs one trip plus k extra
positions per row and k draft tokens (fewer when the drafter drew some ahead, while the
step before was out on remote stages). Auto K takes the k in 0..k_max with the most tokens per
second under the measured costs (`StepCost`): on a slow link (a long trip) it drafts deep; in a
busy group (rows x positions make the step compute-bound) it backs off to 0 by itself. The model
is then checked against the stream's own measured pace (`Pace`): when its steps with drafts have
given fewer tokens per wall second than its steps without, it offers none. Every PROBE_EVERY x
rows steps a stream makes the other choice (none when drafting, the model's K otherwise, unless
even drafts that all stood could not pay: a draft model as dear as the target on a fast link),
so both paces stay measured and the cost's slope sees steps of different widths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shardline.decoding.drafts import Drafter, Proposal
from shardline.decoding.speculative import accepted

PROBE_EVERY = 16
PRIOR_SLOPE = 0.25  # an extra position's cost relative to a one-position step, until measured
MIN_SLOPE = 0.05  # ... and at least this (a fit over few or noisy steps may find none)
MIN_GAIN = 1.1  # drafts only when the model expects them to pay this much: a change of step width
# itself costs (~2 ms a step measured here) and the estimates are noisy, so a marginal gain is none
DECAY = 0.9  # weight of the past in the running acceptance and costs
MIN_PACE_STEPS = 1.5  # decayed steps of each kind before the measured pace overrides the model


@dataclass
class Acceptance:
    """The running rate at which an offered draft stands (given the one before it did): drafts
    that stood over drafts tried (a step tries its drafts up to the first rejected one). The
    prior is one hit in three tries: drafts must prove themselves."""

    hits: float = 1.0
    tries: float = 3.0

    @classmethod
    def prior(cls, rate: float) -> Acceptance:
        """A prior of `rate` worth three tries."""
        return cls(3.0 * rate, 3.0)

    def record(self, offered: int, kept: int) -> None:
        self.hits = DECAY * self.hits + kept
        self.tries = DECAY * self.tries + kept + (1 if kept < offered else 0)

    @property
    def rate(self) -> float:
        return self.hits / self.tries


@dataclass
class StepCost:
    """Measured seconds of a decode step, fitted as base_s + per_token_s x (extra positions):
    `base_s` for one position per row, `per_token_s` for each extra position of a row (a step's
    rows are padded to the longest). A least-squares line over recent steps (older ones decay);
    until steps of different widths were seen, the last slope stands, at first the prior: an
    extra position costs a quarter of a one-row step (measured here: 25-30% for the default model
    on 2 cores, BENCHMARKS.md), and so, as a step of R rows costs (1 + (R - 1) / 4) one-row
    steps, a fraction 1 / (4 + R - 1) of its own base per extra row-position."""

    base_s: float = 0.0
    per_token_s: float = -1.0  # -1: not measured yet
    rows: int = 1  # the steps it times have this many rows
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, x, y, xx, xy (decayed)

    @property
    def _prior(self) -> float:
        """The prior slope relative to the base (see above)."""
        return PRIOR_SLOPE / (1 + PRIOR_SLOPE * (self.rows - 1))

    def record(self, seconds: float, rows: int, width: int) -> None:
        """A step of `rows` rows of `width` positions took `seconds`, planning to outcome."""
        x = float(rows * (width - 1))
        self._sums = [DECAY * a + b for a, b in zip(self._sums, (1.0, x, seconds, x * x, x * seconds), strict=True)]
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        slope = self.per_token_s
        if spread > 1e-9 * max(1.0, n * sxx):
            slope = self.per_token_s = max(0.0, (n * sxy - sx * sy) / spread)
        elif slope < 0:  # one width so far: the prior slope, relative to what was measured
            slope = self._prior * (sy / n) / (1 + self._prior * sx / n)
        self.base_s = max(1e-6, (sy - slope * sx) / n)

    @property
    def slope_s(self) -> float:
        measured = self.per_token_s if self.per_token_s >= 0 else self._prior * self.base_s
        return max(measured, MIN_SLOPE * self.base_s)


@dataclass
class Pace:
    """A stream's measured wall seconds per token, over its steps with drafts and without
    (decayed): from one outcome to the next, so drafting, waiting and the trip all count. What
    `best_k`'s model leaves out shows here: a drafter taking cores the stages need (one machine),
    drafts drawn "ahead" that were not free after all, a group padded by its other rows."""

    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [without drafts, with]
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    steps: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        i = int(drafted)
        self.seconds[i] = DECAY * self.seconds[i] + seconds
        self.tokens[i] = DECAY * self.tokens[i] + tokens
        self.steps[i] = DECAY * self.steps[i] + 1

    def drafts_lose(self) -> bool:
        """Whether steps with drafts have been measured slower per token than steps without."""
        if min(self.steps) < MIN_PACE_STEPS:
            return False
        return self.seconds[1] / self.tokens[1] > self.seconds[0] / self.tokens[0]


@dataclass
class GroupPace:
    """A decode group's measured tokens per wall second over its steps with drafts and without,
    kept per number of rows. A row's drafts pad every row of its group's step and are drawn on
    the engine thread while the others wait; a row's own pace (`Pace`) sees what its drafts
    gave it, not what they cost the others. A step's time runs from the moment the group's step
    before it was settled (so drafting for it counts) to the moment its own last row is.

    Its verdict, for groups of two rows or more: drafts only while steps with drafts have given
    the group at least the tokens per second of steps without; every PROBE_EVERY steps the other
    choice, so both paces stay measured. Hence speculation in a group costs at most the probes
    when it does not pay (the server is never slower with it on than off, beyond that)."""

    paces: dict[int, Pace] = field(default_factory=dict)  # by the step's rows
    allow: bool = True  # whether the group's next step may offer drafts
    _since_probe: int = 0
    _pending: int = 0  # rows of the step in flight not yet settled
    _step: tuple[int, bool, bool] = (0, False, False)  # its rows, whether it drafted, whether steady
    _tokens: int = 0  # tokens its rows have settled
    _settled: float | None = None  # when the step before it was settled (None: not timed)

    def launched(self, rows: int, drafted: bool, steady: bool) -> None:
        """A step of `rows` rows left; `steady`: no row joined (a joiner's prefill ran before
        it, and would be counted)."""
        if self._pending:  # the step before never settled (lost with a chain): time afresh
            self._settled = None
        self._pending, self._step, self._tokens = rows, (rows, drafted, steady), 0

    def settled(self, tokens: int, now: float, members: int) -> None:
        """One row of the step in flight came back with `tokens` tokens that stand; at the
        last, the step is timed and the verdict for the group's next step (of `members` rows)
        is drawn."""
        if not self._pending:
            return
        self._tokens += tokens
        self._pending -= 1
        if self._pending:
            return
        rows, drafted, steady = self._step
        if steady and self._settled is not None:
            self.paces.setdefault(rows, Pace()).record(drafted, now - self._settled, self._tokens)
        self._settled = now
        self.allow = self._verdict(members)

    def _verdict(self, rows: int) -> bool:
        if rows < 2:  # one row: its own pace decides (Speculation.choose_k)
            return True
        lose = rows in self.paces and self.paces[rows].drafts_lose()
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            return lose
        return not lose


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step offering k drafts yields on average: 1 + a + a^2 + ... + a^k."""
    return float(sum(rate**i for i in range(k + 1)))


def best_k(rate: float, cost: StepCost, rows: int, draft_s: float, k_max: int, ready: int = 0) -> int:
    """The k in 0..k_max with the most tokens per second, if that beats no drafts by MIN_GAIN
    (until a step has been timed: 1 if drafts are free, else none); `ready` drafts were drawn
    ahead and cost nothing more. A group's step waits for every row's drafts, drawn one row
    after the other on the engine thread: a row's drafts cost `rows` times their own time."""
    if not cost.base_s:
        return min(1, k_max) if draft_s == 0 else 0
    speed = [expected_tokens(rate, k) / (cost.base_s + rows * (k * cost.slope_s + max(0, k - ready) * draft_s))
             for k in range(k_max + 1)]
    k = int(np.argmax(speed))
    return k if speed[k] >= MIN_GAIN * speed[0] else 0


@dataclass(frozen=True)
class SpecStats:
    """A stream's speculation so far: drafts offered and accepted, verify steps, the last K; and
    by draft position (0: the first draft of a step), how often one was offered and how often it
    stood (a draft stands only if every one before it did)."""

    drafted: int
    accepted: int
    steps: int
    k: int
    offered_at: tuple[int, ...] = ()
    kept_at: tuple[int, ...] = ()

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each step gave: the target's own, and the drafts that stood."""
        return (self.steps + self.accepted) / self.steps if self.steps else 0.0

    def acceptance_at(self) -> list[float]:
        return [kept / offered for kept, offered in zip(self.kept_at, self.offered_at, strict=True)]

    def __add__(self, other: SpecStats) -> SpecStats:
        """The sums of two streams' figures (k: the later one's)."""
        return SpecStats(self.drafted + other.drafted, self.accepted + other.accepted, self.steps + other.steps,
                         other.k, _sum(self.offered_at, other.offered_at), _sum(self.kept_at, other.kept_at))


def _sum(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))


@dataclass(eq=False)
class Speculation:
    drafter: Drafter
    fixed_k: int | None  # None: auto
    k_max: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    pace: Pace = field(default_factory=Pace)
    proposal: Proposal = field(default_factory=lambda: Proposal([]))  # the drafts in flight
    k: int = 0  # drafts chosen for the last step
    planned: bool = False  # drafts (maybe none) chosen for the next step, whose outcome settles them
    drafted: int = 0  # totals over the stream's life
    kept: int = 0
    steps: int = 0
    offered_at: list[int] = field(default_factory=list)  # by draft position, over the stream's life
    kept_at: list[int] = field(default_factory=list)
    _since_probe: int = 0
    _last: float | None = None  # when its last step's outcome was settled

    def stats(self) -> SpecStats:
        return SpecStats(self.drafted, self.kept, self.steps, self.k, tuple(self.offered_at), tuple(self.kept_at))

    def choose_k(self, cost: StepCost, rows: int, room: int, ready: int = 0) -> int:
        """Drafts to offer next: at most `room` (tokens left to generate, minus the target's own);
        `ready` of them were drawn ahead."""
        if self.fixed_k is not None:
            k = self.fixed_k
        else:
            modelled = best_k(self.acceptance.rate, cost, rows, self.drafter.cost_s, self.k_max, ready)
            k = 0 if self.pace.drafts_lose() else modelled
            self._since_probe += 1
            # the other choice now and then: the pace of both must stay measured (and the cost's
            # slope needs steps of different widths); rarer in a bigger group, where one row's
            # drafts pad every row
            if self._since_probe >= PROBE_EVERY * rows:
                self._since_probe = 0
                if k:
                    k = 0
                elif best_k(1.0, cost, rows, self.drafter.cost_s, self.k_max, ready):
                    k = max(1, modelled)  # only if drafts that all stood could pay at all
        self.k = max(0, min(k, room))
        return self.k

    def hold(self) -> None:
        """No drafts for the next step: its group's measured pace says they do not pay."""
        self.k = 0
        self.offer(Proposal([]))

    def offer(self, proposal: Proposal) -> None:
        self.proposal, self.planned = proposal, True

    def worth_following(self, cost: StepCost | None, rows: int) -> bool:
        """Whether its drafter should use idle time: only if drafts could pay at all (they
        never can when a draft costs what the target's step does: following would only take
        cores the stages may need)."""
        if self.fixed_k is not None:
            return True
        return cost is not None and best_k(1.0, cost, rows, self.drafter.cost_s, self.k_max) > 0

    def ahead_limit(self) -> int:
        """How long the drafter's chain may grow while a step is out: the drafts in flight, a
        guess of the target's own next token, and the most the next step may offer."""
        return len(self.proposal.tokens) + 1 + (self.k_max if self.fixed_k is None else self.fixed_k)

    def restart(self) -> None:
        """Its stream starts again after a fault: the drafts in flight are forgotten (the drafter
        follows the text it is given next), and its pace is timed from one outcome to the next,
        never across the outage."""
        self.proposal, self.planned, self._last = Proposal([]), False, None

    def settle(self, chosen: list[int], now: float | None = None) -> int:
        """The target chose `chosen` after each fed position: how many drafts stood. The counters
        (and, given the time `now`, the pace) learn of it; the proposal is cleared (the drafter
        learns from the context it is given next)."""
        drafts = self.proposal.tokens
        kept = accepted(drafts, chosen)
        if now is not None:
            if self._last is not None:
                self.pace.record(bool(drafts), now - self._last, kept + 1)
            self._last = now
        if drafts:
            self.acceptance.record(len(drafts), kept)
            self.drafted += len(drafts)
            self.kept += kept
            self._count_positions(len(drafts), kept)
        self.steps += 1
        self.proposal, self.planned = Proposal([]), False
        return kept

    def _count_positions(self, offered: int, kept: int) -> None:
        grow = offered - len(self.offered_at)
        if grow > 0:
            self.offered_at.extend([0] * grow)
            self.kept_at.extend([0] * grow)
        for i in range(offered):
            self.offered_at[i] += 1
            self.kept_at[i] += i < kept


@dataclass(frozen=True)
class Drafts:
    """A server's speculation: a new drafter for each stream that speculates, and its K policy."""

    new_drafter: Callable[[], Drafter]
    k: int | None  # None: auto
    k_max: int
    prior: float = 1 / 3  # the acceptance a stream's drafts are credited with before they are tried

    def speculation(self) -> Speculation:
        return Speculation(self.new_drafter(), self.k, self.k_max, Acceptance.prior(self.prior))
