"""Prefill pacing (serving/pacing.py), pure, with made-up step times: chunks sized to a time
budget from costs learned online, prefill's share of the time while streams decode, full chunks
when nothing decodes, and a long prompt that always finishes."""

from __future__ import annotations

import pytest

from shardline.config import PacingConfig
from shardline.errors import ShardlineError
from shardline.serving.pacing import EXPLORE, ChunkCosts, Pacing


def cost(n: int, c: int) -> float:
    """A made-up machine: 5 ms a chunk, 1 ms a token, 1 us a token per cached token."""
    return 0.005 + 0.001 * n + 1e-6 * n * c


def taught(costs: ChunkCosts | None = None) -> ChunkCosts:
    costs = costs or ChunkCosts()
    for n, c in [(16, 0), (64, 0), (128, 0), (32, 2048), (128, 4096), (8, 8000)]:
        costs.observe(n, c, cost(n, c))
    return costs


def test_the_cost_model_learns_the_chunks_it_sees() -> None:
    costs = taught()
    for n, c in [(100, 0), (10, 6000), (50, 3000)]:
        assert costs.seconds(n, c) == pytest.approx(cost(n, c), rel=1e-6)


def test_a_chunk_fits_its_budget_whatever_the_context_but_pays_for_its_fixed_cost() -> None:
    costs = taught()
    for c in (0, 1000, 4000, 16000):
        n = costs.tokens_within(0.05, c, cap=512)
        fits = cost(n, c) <= 0.05 + 1e-12 < cost(n + 1, c)
        floor = n == max(1, -(-5 // (1 + c // 1000)))  # ceil(5 ms / the per-token ms)
        assert fits or floor, (c, n)
    assert costs.tokens_within(0.05, 0, cap=512) == 45  # 5 ms + 45 x 1 ms
    assert costs.tokens_within(0.05, 16000, cap=512) == 2  # 17 ms a token: past the budget, the floor
    assert costs.tokens_within(0.004, 0, cap=512) == 5  # under its fixed cost: 5 tokens pay for it once
    assert costs.tokens_within(10.0, 0, cap=128) == 128


def test_until_two_chunk_sizes_are_known_chunks_double() -> None:
    """One size seen cannot split a chunk's fixed cost from its tokens': the per-token cost alone
    would price the fixed one into each token and keep chunks at a token for ever."""
    costs = ChunkCosts()
    assert costs.tokens_within(0.001, 0, cap=128) == EXPLORE and costs.seconds(8, 0) is None
    for _ in range(3):
        costs.observe(16, 40, cost(16, 40))
    assert costs.tokens_within(0.001, 40, cap=128) == 32 and costs.tokens_within(0.001, 40, cap=20) == 20
    costs.observe(32, 56, cost(32, 56))
    assert costs.tokens_within(0.001, 0, cap=128) == 5  # known now: under its fixed cost, the floor


def test_a_few_samples_of_one_size_fit_a_per_token_cost() -> None:
    costs = ChunkCosts()
    costs.observe(128, 0, 0.128)
    assert costs.seconds(64, 0) == pytest.approx(0.064)


def test_nothing_decoding_prefills_full_chunks() -> None:
    p = Pacing(full_chunk=128)
    assert p.sizes([(1000, 0), (50, 0)], decoding=False, prefilling=True) == [128, 50]


def steady(p: Pacing, step_s: float = 0.020, n: int = 10) -> None:
    for _ in range(n):
        p.decode_step(step_s)


def test_while_streams_decode_a_chunk_fits_the_budget() -> None:
    p = Pacing(PacingConfig(budget=1.5, share=0.5), full_chunk=128)
    p.costs = taught()
    assert p.sizes([(3000, 0)], decoding=True, prefilling=True) == [5]  # no step time known yet: the floor
    steady(p, 0.030)
    (n,) = p.sizes([(3000, 0)], decoding=True, prefilling=True)
    assert n == 40 and cost(n, 0) == pytest.approx(1.5 * 0.030)  # 5 ms + 40 ms


def test_chunks_wait_while_prefill_has_taken_more_than_its_share() -> None:
    p = Pacing(PacingConfig(budget=1.0, share=0.5), full_chunk=128)
    p.costs = taught()
    steady(p)
    assert p.sizes([(3000, 0)], decoding=True, prefilling=True)[0] > 0
    p.chunk_done(64, 0, 0.300)  # a slow chunk: 300 ms against ~130 ms of decoding counted
    assert p.behind() and p.sizes([(3000, 64)], decoding=True, prefilling=True) == [0]
    steps = 0
    while p.behind():
        p.decode_step(0.020)
        steps += 1
    assert steps == 6 and p.sizes([(3000, 64)], decoding=True, prefilling=True)[0] > 0


def test_the_share_counts_from_when_prompts_meet_decoding_streams() -> None:
    p = Pacing()
    steady(p, 0.020)
    p.chunk_done(100, 0, 1.0, learn=False)  # a first chunk: counted, not learnt from
    assert p.behind() and p.costs.seconds(1, 0) is None
    p.sizes([], decoding=True, prefilling=False)  # no prompt left: the count starts over
    assert p.share() == 0.0 and not p.behind()
    p.sizes([(100, 0)], decoding=False, prefilling=True)  # nothing decoding: nothing to share
    assert p.share() == 0.0


@pytest.mark.parametrize("share", [0.3, 0.5, 0.7])
def test_a_fake_clock_streams_keep_their_share_and_a_long_prompt_finishes(share: float) -> None:
    """One resource, in turn: a decode step (20 ms of work, plus the chunk planned beside the
    previous one, which it waits behind), then the chunks the pacing plans; the streams' rate
    over the prompt's prefill stays near 1 - share of their steady rate, every gap is bounded,
    and the prompt finishes."""
    p = Pacing(PacingConfig(budget=2.0, share=share), full_chunk=128)
    steady(p)
    clock, left, cached, pending, gaps = 0.0, 8000, 0, 0.0, []
    while left and clock < 3600:
        gap = 0.020 + pending
        p.decode_step(0.020)
        clock, pending = clock + gap, 0.0
        gaps.append(gap)
        (n,) = p.sizes([(left, cached)], decoding=True, prefilling=True)
        if n:
            pending = cost(n, cached)
            p.chunk_done(n, cached, pending)
            left, cached = left - n, cached + n
    assert left == 0
    rate = len(gaps) * 0.020 / clock
    assert rate >= (1 - share) - 0.1, rate
    assert max(gaps) <= 0.020 + max(2.0 * 0.020, cost(2, 8000)) + 0.005


def test_several_prompts_share_the_budget_in_arrival_order() -> None:
    p = Pacing(PacingConfig(budget=1.0, share=0.5), full_chunk=128)
    p.costs = taught()
    steady(p, 0.040)
    first, second = p.sizes([(3000, 0), (3000, 0)], decoding=True, prefilling=True)
    assert first == 35 and second == 0  # the oldest takes the round's budget: 5 ms + 35 ms


@pytest.mark.parametrize("budget,share,why", [(0, 0.5, "--prefill-budget"), (-1, 0.5, "--prefill-budget"),
                                              (1, 0, "--prefill-share"), (1, -0.5, "--prefill-share"),
                                              (1, 1.0, "--prefill-share"), (1e9, 0.5, "--prefill-budget")])
def test_a_zero_or_negative_budget_or_share_is_a_clear_error(budget: float, share: float, why: str) -> None:
    with pytest.raises(ShardlineError, match=why):
        PacingConfig(budget=budget, share=share)
