from __future__ import annotations

import numpy as np
import pytest

from shardline.config import SamplingConfig
from shardline.decoding.sampler import Sampler
from shardline.errors import ShardlineError

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)


def test_greedy_is_argmax() -> None:
    assert Sampler(SamplingConfig(temperature=0))(LOGITS) == 1


def _draw(seed: int) -> list[int]:
    s = Sampler(SamplingConfig(temperature=1.5, seed=seed))
    return [s(LOGITS) for _ in range(50)]


def test_same_seed_same_tokens_other_seed_differs() -> None:
    assert _draw(7) == _draw(7)
    assert _draw(7) != _draw(8)


def test_top_k_keeps_only_k_tokens() -> None:
    p = Sampler(SamplingConfig(temperature=1.0, top_k=2)).probabilities(LOGITS)
    assert set(np.flatnonzero(p)) == {1, 4}
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    full = Sampler(SamplingConfig(temperature=1.0)).probabilities(LOGITS)
    order = np.argsort(-full)
    p = Sampler(SamplingConfig(temperature=1.0, top_p=0.5)).probabilities(LOGITS)
    need = int(np.searchsorted(np.cumsum(full[order]), 0.5)) + 1
    assert set(np.flatnonzero(p)) == set(order[:need].tolist())
    tiny = Sampler(SamplingConfig(temperature=1.0, top_p=1e-9)).probabilities(LOGITS)
    assert np.flatnonzero(tiny).tolist() == [1]


def test_sampled_frequencies_follow_the_distribution() -> None:
    s = Sampler(SamplingConfig(temperature=1.0, seed=0))
    counts = np.bincount([s(LOGITS) for _ in range(4000)], minlength=5) / 4000
    np.testing.assert_allclose(counts, s.probabilities(LOGITS), atol=0.03)


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top-p"), ({"top_k": -1}, "top-k"),
    ({"max_tokens": 0}, "max tokens"),
])
def test_invalid_config(kw: dict, msg: str) -> None:
    with pytest.raises(ShardlineError, match=msg):
        SamplingConfig(**kw)


def test_choice_carries_the_log_probability_under_the_raw_distribution() -> None:
    choice = Sampler(SamplingConfig(temperature=0)).choose(LOGITS)
    expect = LOGITS[1] - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert choice.token == 1 and choice.logprob == pytest.approx(expect, abs=1e-9)
