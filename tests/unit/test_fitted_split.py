"""--balance with --memory (issue 38, point 3): a stage fits its node's memory first, then the
slowest stage's work per token is the least it can be. Pure: export/plan.py's fitted_split."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.config import ExportConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import stage_costs
from shardline.export.plan import StageCosts, fitted_split
from shardline.model.arch import Arch

GIB = 1 << 30
# Qwen3-30B-A3B's shape: 128 experts of 768 rows, 8 used per token.
QWEN3_30B = Arch(family="qwen3moe", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                 intermediate=6144, vocab=151936, rope_theta=1e6, rms_eps=1e-6, tied_embeddings=False,
                 max_context=40960, experts=128, experts_used=8, expert_ffn=768)


def ranges(n: int, budgets: list[float], c: StageCosts) -> list[tuple[int, int]]:
    return [(p.first, p.last) for p in fitted_split(n, budgets, c)]


def test_with_room_everywhere_it_evens_the_work_the_head_counted() -> None:
    dense = StageCosts(layer_work=1.0, layer_size=1.0, head_work=8.0, first_size=8.0, last_size=8.0)
    assert ranges(30, [math.inf, math.inf], dense) == [(0, 18), (19, 29)]  # work 19 and 11 + 8
    assert ranges(30, [math.inf], dense) == [(0, 29)]


def test_a_node_short_of_memory_takes_fewer_layers_than_its_share_of_the_work() -> None:
    moe = StageCosts(layer_work=1.0, layer_size=10.0, head_work=8.0, first_size=8.0, last_size=8.0)
    assert ranges(30, [math.inf, math.inf], moe) == [(0, 18), (19, 29)]
    # 108 holds the embedding and 10 layers: the rest goes to the second node, though slower.
    assert ranges(30, [108.0, math.inf], moe) == [(0, 9), (10, 29)]
    assert ranges(30, [math.inf, 108.0], moe) == [(0, 19), (20, 29)]  # 8 + 10 layers = 108


def test_too_little_memory_is_a_clear_error() -> None:
    moe = StageCosts(layer_work=1.0, layer_size=10.0, head_work=8.0, first_size=8.0, last_size=8.0)
    with pytest.raises(ShardlineError, match="stage 1's memory \\(0.0 GiB\\) cannot hold even one layer"):
        ranges(30, [math.inf, 17.0], moe)
    with pytest.raises(ShardlineError, match="the 30 layers need about 0.0 GiB across the stages, more than their "
                                             "memory holds"):
        ranges(30, [150.0, 150.0], moe)


def test_a_mixtures_stages_are_sized_by_every_expert_and_timed_by_the_active_ones() -> None:
    c = stage_costs(QWEN3_30B, 0.6)
    assert c.layer_size / c.layer_work == pytest.approx((1.1 * 604.0 + 1.8 * 19.1) / 56.9, rel=1e-2)
    assert QWEN3_30B.head_layers == pytest.approx(151936 * 2048 / 56.9e6, rel=1e-2)  # ~5.5 active layers
    plans = fitted_split(48, [20 * GIB] * 4, c)
    assert [len(p.layers) for p in plans] == [14, 13, 13, 8]  # the last also runs the head: ~5.5 layers' work
    # A 4 GiB node holds 9 layers (0.39 GiB each, the embedding 0.19): the 8 GiB ones take the rest.
    assert [len(p.layers) for p in fitted_split(48, [4 * GIB, 8 * GIB, 8 * GIB, 8 * GIB], c)] == [9, 15, 15, 9]
    for p in plans:
        assert len(p.layers) * c.layer_size + c.extra(p.index, 4) <= 20 * GIB


def _best_work(n: int, budgets: list[float], c: StageCosts) -> float:
    """The least work of the slowest stage over every contiguous split that fits (brute force)."""
    best = math.inf
    for cuts in itertools.combinations(range(1, n), len(budgets) - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
        fits = all(k * c.layer_size + c.extra(s, len(sizes)) <= budgets[s] for s, k in enumerate(sizes))
        if fits:
            best = min(best, max(k * c.layer_work + (c.head_work if s == len(sizes) - 1 else 0)
                                 for s, k in enumerate(sizes)))
    return best


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10), budgets=st.lists(st.integers(1, 60), min_size=1, max_size=4),
       size=st.integers(1, 6), head=st.integers(0, 9), edge=st.integers(0, 9))
def test_it_fits_every_stage_and_is_as_fast_as_any_split_that_fits(n: int, budgets: list[int], size: int,
                                                                    head: int, edge: int) -> None:
    c = StageCosts(layer_work=1.0, layer_size=float(size), head_work=float(head), first_size=float(edge),
                   last_size=float(edge))
    if len(budgets) > n:
        return
    best = _best_work(n, [float(b) for b in budgets], c)
    if best == math.inf:
        with pytest.raises(ShardlineError, match="memory"):
            fitted_split(n, [float(b) for b in budgets], c)
        return
    plans = fitted_split(n, [float(b) for b in budgets], c)
    assert [p.first for p in plans] == [0, *(p.last + 1 for p in plans[:-1])] and plans[-1].last == n - 1
    assert all(len(p.layers) * c.layer_size + c.extra(p.index, len(plans)) <= budgets[p.index] for p in plans)
    assert max(len(p.layers) + (head if p.has_head else 0) for p in plans) == best


@pytest.mark.parametrize("fields, message", [
    ({"memory": (8.0,)}, "--memory sizes the split --balance makes: give --balance too"),
    ({"memory": (8.0, 8.0), "balance": True}, "--memory takes one size for every stage or one per stage \\(3\\)"),
    ({"memory": (8.0, 0.0, 8.0), "balance": True}, "--memory sizes must be positive GiB"),
    ({"memory": (float("nan"),), "balance": True}, "--memory sizes must be positive GiB"),
])
def test_memory_sizes_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        ExportConfig(out=__import__("pathlib").Path("/nonexistent"), stages=3, **fields)  # type: ignore[arg-type]
