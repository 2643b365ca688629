"""Speculation's pure parts: prompt lookup, the accept rule, speculative sampling's draw (a
statistical test: it samples the target's distribution whatever the draft's), the choice of K,
and the verify steps the scheduler plans (rows with different K, compaction)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from scipy.stats import chisquare

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal, drafted
from shardline.decoding.lookup import PromptLookup
from shardline.decoding.sampler import choose_at, probabilities
from shardline.decoding.speculative import Drafted, accepted, verify_draw
from shardline.pipeline.plan import DecodeStep
from shardline.serving.drafters import LOOKUP_PRIOR
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.speculation import (
    PROBE_EVERY,
    Acceptance,
    Drafts,
    SpecStats,
    Speculation,
    StepCost,
    best_k,
    expected_tokens,
)
from shardline.serving.stream import Stream


def test_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    look = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], max_ngram=3)
    assert look.propose(3) == [4, 5, 9]  # "1 2 3" (longest) beats the later "2 3" (-> 7 8 1)
    look = PromptLookup([5, 6, 7, 8, 5, 6])
    assert look.propose(2) == [7, 8]
    assert look.propose(10) == [7, 8, 5, 6]  # never past the end of the text
    assert PromptLookup([1, 2, 3]).propose(4) == []  # the suffix never matches itself
    look.extend([7])
    assert look.propose(1) == [8]


def test_accepted_counts_the_leading_drafts_equal_to_the_targets_choices() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5], [4, 5]) == 0
    assert accepted([], [3]) == 0


def _chi2(draws: list[int], p: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=len(p))
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside p's support was drawn"
    return float(chisquare(counts[support], p[support] * len(draws)).pvalue)


@pytest.mark.parametrize("q", [[0.1, 0.6, 0.1, 0.1, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                               [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]], ids=["skewed", "point-mass", "near-p"])
def test_speculative_sampling_draws_the_targets_distribution_whatever_the_draft(q: list[float]) -> None:
    p = np.array([0.05, 0.15, 0.3, 0.2, 0.2, 0.1])
    qv = np.array(q)
    rng = np.random.default_rng(0)
    draws = []
    for seed in range(6000):
        draft = int(rng.choice(6, p=qv))
        draws.append(verify_draw(p, draft, qv, seed, 17))
    assert _chi2(draws, p) > 1e-3


def test_choose_at_verifies_drafts_from_their_support_at_the_last_stage() -> None:
    """The sampler's path: logits, the request's temperature and top-k, q's support only."""
    logits = np.log(np.array([0.05, 0.15, 0.3, 0.2, 0.2, 0.1], np.float32))
    params = [SamplingParams(temperature=0.8, top_k=4, seed=s) for s in range(5000)]
    p = probabilities(logits, params[0])
    q_ids, q_probs = np.array([[1, 2, -1]]), np.array([[0.7, 0.3, 0.0]], np.float32)
    draws = []
    for par in params:
        draft = 1 if np.random.default_rng(par.seed + 99).random() < 0.7 else 2
        (c,) = choose_at(logits[None, None], np.array([[0, 0]]), np.array([0]), np.array([[4]]), [par],
                         drafted=Drafted(np.array([draft]), q_ids, q_probs))
        draws.append(c.token)
    assert _chi2(draws, p) > 1e-3


def test_a_draft_outside_its_support_or_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the support"):
        verify_draw(np.full(4, 0.25), 3, np.array([0.5, 0.5, 0, 0]), 1, 2)
    logits = np.zeros((1, 1, 4), np.float32)
    got = choose_at(logits, np.array([[0, 0]]), np.array([0]), np.array([[0]]), [SamplingParams(temperature=1.0)],
                    drafted=Drafted(np.array([7]), np.array([[7]]), np.array([[1.0]], np.float32)))
    assert [(c.token, c.why) for c in got] == [(-1, "a draft or its support is outside the vocabulary")]


def test_k_is_deep_on_a_slow_link_and_backs_off_when_compute_bound() -> None:
    slow_link = StepCost(base_s=0.2, per_token_s=0.002)
    assert best_k(0.7, slow_link, rows=1, draft_s=0.0, k_max=8) >= 6
    busy = StepCost(base_s=0.05, per_token_s=0.01)
    assert best_k(0.7, busy, rows=8, draft_s=0.0, k_max=8) == 0
    assert best_k(0.05, StepCost(0.02, 0.001), rows=1, draft_s=0.0, k_max=8) == 0  # drafts never stand
    assert best_k(0.9, StepCost(0.02, 0.0), rows=1, draft_s=0.02, k_max=8) <= 3  # a draft costs a trip
    group = StepCost(base_s=0.06, per_token_s=0.002)  # a group of 4 waits for 4 rows' drafts
    assert best_k(0.9, group, rows=1, draft_s=0.015, k_max=8) >= 3
    assert best_k(0.9, group, rows=4, draft_s=0.015, k_max=8) == 0
    assert best_k(0.9, group, rows=4, draft_s=0.015, k_max=8, ready=8) >= 3  # unless drawn ahead
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_learns_and_forgets() -> None:
    a = Acceptance()
    for _ in range(30):
        a.record(4, 4)
    assert a.rate > 0.9
    for _ in range(30):
        a.record(4, 0)
    assert a.rate < 0.2


def test_step_cost_separates_the_trip_from_each_extra_position() -> None:
    cost = StepCost()
    for _ in range(40):
        cost.record(0.1, 1, 1)
        cost.record(0.1 + 4 * 2 * 0.005, 2, 5)
    assert cost.base_s == pytest.approx(0.1) and cost.per_token_s == pytest.approx(0.005)


class _Fixed:
    cost_s = 0.0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        return Proposal(self.tokens[:k])

    def ready(self, context: list[int]) -> int:
        return 0

    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool:
        return False

    def close(self) -> None: ...


def _decoding(i: int, drafts: list[int], k: int) -> Stream:
    s = Stream(i, [1, 2, 3], SamplingParams(), 50)
    s.prefilled, s.generated = 3, [9]
    s.book.commit(s.book.plan([1, 2, 3]))
    s.spec = Speculation(_Fixed(drafts), k, 8)
    s.spec.offer(s.spec.drafter.propose([], s.spec.choose_k(StepCost(), 1, 50), s.params))
    return s


def _offered(sched: KeyedScheduler) -> dict[int, Proposal]:
    """What the engine's speculation hands the scheduler: each stream's drafts, by stream."""
    return {s.id: s.spec.proposal for s in sched.streams.values() if s.spec and s.spec.planned}


def test_a_group_verifies_rows_with_different_k_padded_to_the_longest() -> None:
    sched = KeyedScheduler(SchedulerConfig(groups=1))
    a, b = _decoding(1, [4, 5, 6], 3), _decoding(2, [7], 1)
    sched.add(a)
    sched.add(b)
    (step,) = sched.plan(_offered(sched)).steps
    assert isinstance(step, DecodeStep) and step.merge == (1, 2)
    assert step.inputs.input_ids.tolist() == [[9, 4, 5, 6], [9, 7, 7, 7]]
    assert step.inputs.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]
    assert step.sample_at.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1]]
    assert (a.book.position, b.book.position) == (7, 5)


def test_a_verify_step_of_one_stream_compacts_once_enough_slots_are_masked() -> None:
    sched = KeyedScheduler(SchedulerConfig(groups=0, compact_at=3))
    s = _decoding(1, [4, 5, 6], 3)
    s.book.commit(s.book.plan([9, 4, 5, 6]))
    s.book.mask_last(3)  # three drafts rejected
    sched.add(s)
    (step,) = sched.plan(_offered(sched)).steps
    assert isinstance(step, DecodeStep) and step.compact
    assert step.inputs.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]]
    assert (s.book.slots, s.book.masked, s.book.position) == (8, 0, 8)


def test_drafted_entries_line_up_with_every_sampled_position() -> None:
    q = Proposal([5, 6], np.array([[5, 1], [6, -1]]), np.array([[0.5, 0.5], [1.0, 0.0]], np.float32))
    d = drafted([Proposal([3]), q])
    assert d is not None
    assert d.tokens.tolist() == [-1, -1, 5, 6, -1]  # row 0: a certain draft needs nothing sent
    assert d.q_ids.tolist() == [[-1, -1], [-1, -1], [5, 1], [6, -1], [-1, -1]]
    assert drafted([Proposal([3]), Proposal([])]) is None


def test_a_speculating_stream_never_holds_more_slots_than_admission_counts() -> None:
    """Any run of accepts and rejects, alone or in a group: the physical cache stays within the
    (group's longest) text so far + compact_at + k_max + 1 slots: at the longest context, what
    server.stream_limits budgets per stream."""
    rng = np.random.default_rng(1)
    for groups in (0, 1):
        sched = KeyedScheduler(SchedulerConfig(groups=groups, compact_at=16))
        streams = [_decoding(i, list(range(50, 58)), 8) for i in (1, 2)]
        for s in streams:
            s.max_tokens = 10**6
            sched.add(s)
        compactions = 0
        for _ in range(200):
            for step in sched.plan(_offered(sched)).steps:
                compactions += isinstance(step, DecodeStep) and step.compact
                for r, sid in enumerate(step.streams):
                    s = sched.streams[sid]
                    s.in_flight = False
                    assert s.spec is not None
                    offered = len(s.spec.proposal.tokens)
                    kept = int(rng.integers(0, offered + 1))
                    chosen = s.spec.proposal.tokens[:kept] + [7] * (offered + 1 - kept)
                    assert step.entries(r) == offered + 1
                    s.spec.settle(chosen)
                    s.book.mask_last(offered - kept)
                    s.generated += chosen[: kept + 1]
                    longest = max(len(x.prompt) + len(x.generated) for x in streams)  # a group's rows are padded to it
                    assert s.book.slots <= longest + 16 + 8 + 1
                    s.spec.offer(s.spec.drafter.propose([], 8, s.params))
        assert all(s.book.position == len(s.prompt) + len(s.generated) - 1 for s in streams)
        assert compactions > 10, (groups, compactions)


def _paced(spec: Speculation, steps: int, seconds: Callable[[int], float]) -> list[int]:
    """`steps` steps on a slow link where every draft stands and a step offering k drafts
    takes seconds(k): the K chosen at each."""
    slow_link = StepCost(base_s=0.2, per_token_s=0.002)
    now, ks = 0.0, []
    for _ in range(steps):
        k = spec.choose_k(slow_link, rows=1, room=100)
        ks.append(k)
        spec.offer(spec.drafter.propose([], k, SamplingParams()))
        now += seconds(k)
        spec.settle(list(range(50, 50 + k)) + [7], now)
    return ks


def test_auto_k_backs_off_when_drafted_steps_measure_slower_and_probes_back() -> None:
    """The model says drafts pay (a slow link, drafts that stand); the stream's measured pace
    says they cost more than they give (0.3 s a token against 0.2 s): it stops
    offering drafts, but for one step in every PROBE_EVERY, which keeps both paces measured."""
    spec = Speculation(_Fixed(list(range(50, 58))), None, 8)
    ks = _paced(spec, 6 * PROBE_EVERY, lambda k: 0.3 * (k + 1) if k else 0.2)  # 0.3 s a token with drafts
    late = ks[2 * PROBE_EVERY:]
    assert ks[0] > 0 and late.count(0) > len(late) * 0.8 and any(late), ks
    assert spec.pace.drafts_lose()


def test_auto_k_keeps_drafting_while_drafted_steps_measure_faster() -> None:
    spec = Speculation(_Fixed(list(range(50, 58))), None, 8)
    ks = _paced(spec, 4 * PROBE_EVERY, lambda k: 0.25 if k else 0.2)
    assert ks.count(0) <= 4 and not spec.pace.drafts_lose(), ks


class _Dear(_Fixed):
    cost_s = 0.02  # a draft token costs what a whole step does


def test_drafts_that_could_never_pay_are_never_tried() -> None:
    """A draft model as dear as the target on a fast link: even drafts that all stood would not
    pay, so auto K offers none, from the first step (before any step was timed) and at probes."""
    spec = Speculation(_Dear(list(range(50, 58))), None, 8)
    assert spec.choose_k(StepCost(), rows=1, room=100) == 0  # untimed: not tried blind
    fast = StepCost(base_s=0.02, per_token_s=0.005)
    assert [spec.choose_k(fast, rows=1, room=100) for _ in range(3 * PROBE_EVERY)] == [0] * 3 * PROBE_EVERY
    lookup = Speculation(_Fixed([1, 2]), None, 8)
    assert lookup.choose_k(StepCost(), rows=1, room=100) == 1  # free drafts are tried at once


def test_prompt_lookup_is_credited_with_its_measured_acceptance_before_it_drafts() -> None:
    """On a fast link an extra verified position costs a quarter of a step: a free draft pays
    only if likelier than ~40% to stand. At the default prior (1 in 3) prompt lookup would never
    offer its first draft; at its own (LOOKUP_PRIOR) it does, and then its record decides."""
    fast = StepCost(base_s=0.01, per_token_s=0.0025)
    assert Drafts(lambda: _Fixed([1, 2]), None, 8).speculation().choose_k(fast, rows=1, room=100) == 0
    spec = Drafts(lambda: _Fixed([1, 2]), None, 8, LOOKUP_PRIOR).speculation()
    assert spec.acceptance.rate == pytest.approx(LOOKUP_PRIOR)
    assert spec.choose_k(fast, rows=1, room=100) >= 1
    for _ in range(6):  # its drafts keep failing: it stops
        spec.offer(Proposal([1]))
        spec.settle([7, 7])
    assert spec.choose_k(fast, rows=1, room=100) == 0


def test_the_scheduler_places_only_the_drafts_it_is_given() -> None:
    """Speculation decides the drafts; the scheduler reads no stream's speculation, it places
    what the plan call hands it (here: none, then the stream's own)."""
    for groups in (0, 1):
        plain, spec = KeyedScheduler(SchedulerConfig(groups=groups)), KeyedScheduler(SchedulerConfig(groups=groups))
        plain.add(_decoding(1, [4, 5, 6], 3))
        spec.add(_decoding(1, [4, 5, 6], 3))
        (a,) = plain.plan().steps
        (b,) = spec.plan(_offered(spec)).steps
        assert a.inputs.input_ids.tolist() == [[9]] and a.sample_at.tolist() == [[0, 0]]
        assert b.inputs.input_ids.tolist() == [[9, 4, 5, 6]] and len(b.sample_at) == 4


def test_acceptance_is_counted_by_draft_position_and_summed_over_streams() -> None:
    """A draft stands only if every one before it did: position i counts the steps that offered
    at least i + 1 drafts, and those whose first i + 1 all stood."""
    spec = Speculation(_Fixed([]), 4, 8)
    for drafts, chosen in (([5, 6, 7], [5, 6, 9, 1]), ([5, 6], [4, 6, 1]), ([5], [5, 2]), ([], [3])):
        spec.offer(Proposal(drafts))
        spec.settle(chosen)
    stats = spec.stats()
    assert (stats.offered_at, stats.kept_at) == ((3, 2, 1), (2, 1, 0))
    assert stats.acceptance_at() == [2 / 3, 1 / 2, 0.0]
    assert (stats.drafted, stats.accepted, stats.steps) == (6, 3, 4)
    assert stats.tokens_per_step == (4 + 3) / 4
    total = SpecStats(1, 1, 2, 0, (1,), (1,)) + stats
    assert (total.drafted, total.accepted, total.steps, total.offered_at, total.kept_at) == (7, 4, 6, (4, 2, 1),
                                                                                           (3, 1, 0))
