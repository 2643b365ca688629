"""The sampler: greedy, temperature, top-k / top-p; randomness from (seed, position) only."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.config import MAX_SEED, SamplingConfig, SamplingParams
from shardline.decoding.sampler import BadLogits, choose, choose_at, log_softmax, probabilities, top_logprobs
from shardline.errors import ShardlineError
from shardline.stage.cache import logits_index

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)


def test_greedy_is_argmax() -> None:
    assert choose(LOGITS, SamplingParams(), 0).token == 1


def _draws(seed: int, temperature: float = 1.5) -> list[int]:
    p = SamplingParams(temperature=temperature, seed=seed)
    return [choose(LOGITS, p, pos).token for pos in range(50)]


def test_same_seed_same_tokens_other_seed_differs() -> None:
    assert _draws(7) == _draws(7)
    assert _draws(7) != _draws(8)


def test_a_choice_depends_only_on_seed_and_position() -> None:
    """No state: any order of calls gives each position its own token."""
    p = SamplingParams(temperature=1.5, seed=3)
    forward = [choose(LOGITS, p, pos).token for pos in range(40)]
    backward = [choose(LOGITS, p, pos).token for pos in reversed(range(40))][::-1]
    assert forward == backward
    assert len(set(forward)) > 1


def test_top_k_keeps_only_k_tokens() -> None:
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(np.flatnonzero(p)) == {1, 4}
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    full = probabilities(LOGITS, SamplingParams(temperature=1.0))
    order = np.argsort(-full)
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.5))
    need = int(np.searchsorted(np.cumsum(full[order]), 0.5)) + 1
    assert set(np.flatnonzero(p)) == set(order[:need].tolist())
    tiny = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=1e-9))
    assert np.flatnonzero(tiny).tolist() == [1]


def test_sampled_frequencies_follow_the_distribution() -> None:
    p = SamplingParams(temperature=1.0, seed=0)
    counts = np.bincount([choose(LOGITS, p, pos).token for pos in range(4000)], minlength=5) / 4000
    np.testing.assert_allclose(counts, probabilities(LOGITS, p), atol=0.03)


def test_the_smallest_temperature_gives_the_argmax_not_nan() -> None:
    """1e-308 used to overflow logits / temperature to inf and the distribution to NaN; the
    smallest temperature allowed now puts all the mass on the maximum."""
    huge = np.array([900.0, 899.0, -50.0], np.float32)
    p = SamplingParams(temperature=1e-3, seed=1)
    assert np.isfinite(probabilities(huge, p)).all()
    assert {choose(huge, p, pos).token for pos in range(20)} == {0}


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -1}, "temperature"), ({"temperature": 1e-308}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0}, "top-p"), ({"top_p": float("nan")}, "top-p"), ({"top_k": -1}, "top-k"),
    ({"max_tokens": 0}, "max tokens"), ({"seed": -1}, "seed"), ({"seed": MAX_SEED + 1}, "seed"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
])
def test_invalid_config(kw: dict, msg: str) -> None:
    with pytest.raises(ShardlineError, match=msg):
        SamplingConfig(**kw)


def test_choice_carries_the_log_probability_and_the_top_alternatives() -> None:
    choice = choose(LOGITS, SamplingParams(top_logprobs=3), 0)
    logp = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert choice.token == 1 and choice.logprob == pytest.approx(logp[1], abs=1e-9)
    assert [t for t, _ in choice.top] == [1, 4, 2]
    assert [lp for _, lp in choice.top] == pytest.approx([logp[1], logp[4], logp[2]], abs=1e-9)
    assert choose(LOGITS, SamplingParams(), 0).top == ()


def test_logits_that_are_not_finite_are_refused() -> None:
    with pytest.raises(BadLogits):
        choose(np.array([1.0, np.nan], np.float32), SamplingParams(), 0)


def test_choose_at_maps_every_asked_position_to_its_logits() -> None:
    """Row 0 asks for t = 0 and 2, row 1 for t = 1: the graph gathers [[0, 2], [1, 1]]."""
    sample_at = np.array([[0, 0], [0, 2], [1, 1]], np.int64)
    index, pick = logits_index(sample_at, 2)
    assert index.tolist() == [[0, 2], [1, 1]] and pick.tolist() == [0, 1, 0]
    logits = np.zeros((2, 2, 5), np.float32)
    logits[0, 0, 3] = logits[0, 1, 4] = logits[1, 0, 2] = 9.0
    positions = np.array([[10, 11, 12], [4, 5, 6]], np.int64)
    got = choose_at(logits, sample_at, pick, positions, [SamplingParams(), SamplingParams()])
    assert [c.token for c in got] == [3, 4, 2]
    assert logits_index(np.zeros((0, 2), np.int64), 3)[0].shape == (3, 0)  # a chunk that samples nothing


def test_top_logprobs_are_sorted_and_agree_with_log_softmax() -> None:
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    logp = log_softmax(logits)
    top = top_logprobs(logp, 5)
    assert [t for t, _ in top] == list(np.argsort(-logits)[:5])
    assert all(lp == pytest.approx(logp[t]) for t, lp in top)
    assert len(top_logprobs(logp[:3], 10)) == 3
