"""Workload generation: classes within their thresholds, an even Mixed, Poisson arrivals, seeds."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from shardline_tools.sim.workloads import (
    CLASSES,
    KINDS,
    RequestSpec,
    Thresholds,
    Workload,
    describe,
    generate,
)

from shardline.errors import ShardlineError


def _gaps(specs: list[RequestSpec]) -> np.ndarray:
    """Inter-arrival gaps, the first one from time 0 (a Poisson process starts there)."""
    return np.diff([0.0] + [s.arrival_s for s in specs])


@pytest.mark.parametrize("kind", KINDS)
def test_a_seed_gives_the_same_requests_and_another_seed_others(kind: str) -> None:
    a = generate(Workload(kind, 50, 2.0, seed=3))
    assert a == generate(Workload(kind, 50, 2.0, seed=3))
    assert a != generate(Workload(kind, 50, 2.0, seed=4))
    assert [s.index for s in a] == list(range(50))
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:], strict=False))


def test_every_class_shares_the_arrivals_of_its_seed() -> None:
    """Classes are compared under the same arrival times; only the lengths differ."""
    arrivals = {k: [s.arrival_s for s in generate(Workload(k, 40, 3.0, seed=9))] for k in KINDS}
    assert all(a == arrivals["LPLD"] for a in arrivals.values())


@pytest.mark.parametrize("kind", CLASSES)
def test_every_class_length_is_inside_its_thresholds(kind: str) -> None:
    th = Thresholds()
    (plo, phi), (dlo, dhi) = th.ranges(kind)
    specs = generate(Workload(kind, 2000, 10.0), th)
    prompts, decodes = [s.prompt_tokens for s in specs], [s.decode_tokens for s in specs]
    assert all(s.kind == kind for s in specs)
    assert plo <= min(prompts) and max(prompts) <= phi
    assert dlo <= min(decodes) and max(decodes) <= dhi
    # Uniform over the range: both ends are reached (light decodes) or nearly (the rest), and the
    # mean sits near the midpoint.
    assert min(prompts) < plo + 0.02 * (phi - plo) and max(prompts) > phi - 0.02 * (phi - plo)
    assert abs(np.mean(decodes) - (dlo + dhi) / 2) < 0.05 * (dhi - dlo)


def test_heavy_and_light_mean_what_the_docstring_says() -> None:
    th = Thresholds()
    assert th.ranges("LPLD") == ((32, 128), (8, 32))
    assert th.ranges("HPHD") == ((256, 1024), (64, 256))
    assert th.ranges("LPHD") == ((32, 128), (64, 256))
    assert th.ranges("HPLD") == ((256, 1024), (8, 32))
    with pytest.raises(ShardlineError, match="no length ranges for 'Mixed'"):
        th.ranges("Mixed")


def test_custom_thresholds_are_used() -> None:
    th = Thresholds(light_prompt=(4, 4), heavy_prompt=(9, 9), light_decode=(1, 1), heavy_decode=(2, 2), context=11)
    specs = generate(Workload("Mixed", 8, 1.0), th)
    assert {(s.kind, s.prompt_tokens, s.decode_tokens) for s in specs} == {
        ("LPLD", 4, 1), ("LPHD", 4, 2), ("HPLD", 9, 1), ("HPHD", 9, 2)}


def test_mixed_is_an_even_mix_of_the_four_classes_each_in_its_range() -> None:
    th = Thresholds()
    specs = generate(Workload("Mixed", 402, 5.0, seed=1), th)
    counts = {k: sum(s.kind == k for s in specs) for k in CLASSES}
    assert set(counts) == set(CLASSES) and max(counts.values()) - min(counts.values()) <= 1
    assert sum(counts.values()) == 402
    for s in specs:
        (plo, phi), (dlo, dhi) = th.ranges(s.kind)
        assert plo <= s.prompt_tokens <= phi and dlo <= s.decode_tokens <= dhi
    # Shuffled, not in blocks: the first dozen already holds several classes.
    assert len({s.kind for s in specs[:12]}) >= 3
    assert sorted(s.kind for s in generate(Workload("Mixed", 4, 1.0, seed=5))) == sorted(CLASSES)


def test_arrivals_are_poisson_at_the_asked_rate() -> None:
    rate = 4.0
    gaps = _gaps(generate(Workload("Mixed", 5000, rate, seed=0)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)  # the standard error is 1.4%
    # The default seed's gaps fit the exponential of mean 1/rate (p ~0.9, far above the bar) ...
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # ... and the test has the power to reject a rate 20% off.
    assert stats.kstest(gaps, "expon", args=(0, 1.2 / rate)).pvalue < 1e-6


def test_describe_counts_and_means_per_class() -> None:
    specs = [RequestSpec(0, 0.5, 100, 10, "LPLD"), RequestSpec(1, 1.0, 50, 20, "LPLD"),
             RequestSpec(2, 2.0, 600, 100, "HPHD")]
    rows = describe(specs)
    assert list(rows) == ["LPLD", "HPHD", "all"]
    assert rows["LPLD"].as_dict() == {"class": "LPLD", "count": 2, "mean_prompt": 75.0, "mean_decode": 15.0}
    assert rows["HPHD"].count == 1 and rows["HPHD"].mean_prompt == 600
    assert rows["all"].as_dict() == {"class": "all", "count": 3, "mean_prompt": 250.0, "mean_decode": 43.3}
    with pytest.raises(ShardlineError, match="no requests to describe"):
        describe([])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "LPMD"}, "unknown workload class 'LPMD'; expected one of LPLD, LPHD, HPLD, HPHD, Mixed"),
    ({"requests": 0}, "at least one request, got 0"),
    ({"rate": 0.0}, "positive finite number per second, got 0.0"),
    ({"rate": float("nan")}, "positive finite number per second, got nan"),
    ({"rate": float("inf")}, "positive finite number per second, got inf"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"kind": "Mixed", "requests": 3}, "Mixed workload needs at least 4 requests"),
])
def test_invalid_workloads_are_refused(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"kind": "LPLD", "requests": 10, "rate": 1.0, "seed": 0} | kwargs
    with pytest.raises(ShardlineError, match=message):
        Workload(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"light_prompt": (0, 128)}, r"light_prompt must be a range of integers 1 <= low <= high, got \(0, 128\)"),
    ({"heavy_decode": (256, 64)}, "heavy_decode must be a range"),
    ({"light_decode": (8.0, 32)}, "light_decode must be a range of integers"),
    ({"light_prompt": (32, 256)}, "a light range must end below the start of its heavy range"),
    ({"light_decode": (8, 64)}, "a light range must end below the start of its heavy range"),
    ({"context": 1024}, r"the longest request \(1280 tokens\) does not fit the context \(1024\)"),
])
def test_invalid_thresholds_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        Thresholds(**kwargs)  # type: ignore[arg-type]


def test_a_request_spec_checks_itself() -> None:
    with pytest.raises(ShardlineError, match="at least one prompt and decode token"):
        RequestSpec(0, 0.0, 0, 5, "LPLD")
    with pytest.raises(ShardlineError, match="class must be one of"):
        RequestSpec(0, 0.0, 5, 5, "Mixed")
