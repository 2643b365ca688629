"""Serving metrics on small hand-computed runs (times are binary fractions, so figures compare exactly)."""

from __future__ import annotations

import json

import pytest
from shardline_tools.sim.metrics import (
    Percentiles,
    RequestRecord,
    Slo,
    instance_seconds_busy,
    merged_seconds,
    percentile,
    summarize,
)

from shardline.errors import ShardlineError

# arrival, first token, finish, tokens -> TTFT, JCT, TPOT
RECORDS = [
    RequestRecord(0.0, 0.5, 2.5, 5),  # 0.5, 2.5, 0.5: misses the TPOT target
    RequestRecord(1.0, 1.25, 2.25, 9),  # 0.25, 1.25, 0.125: meets both
    RequestRecord(2.0, 4.0, 5.0, 9),  # 2.0, 3.0, 0.125: misses the TTFT target
    RequestRecord(3.0, 3.125, 3.125, 1),  # 0.125, 0.125, none: meets both (no token after the first)
]
SLO = Slo(ttft_s=1.0, tpot_s=0.25)
BUSY = {"prefill-0": [(0.0, 2.0), (1.0, 3.0)], "decode-0": [(2.0, 4.5), (4.0, 7.0)], "decode-1": []}


def test_nearest_rank_percentiles() -> None:
    values = [7.0, 1.0, 10.0, 3.0, 5.0, 2.0, 9.0, 4.0, 8.0, 6.0]  # 1..10, shuffled
    assert percentile(values, 50) == 5.0  # rank ceil(5.0) = 5
    assert percentile(values, 90) == 9.0  # rank ceil(9.0) = 9, not 10 (no float rounding up)
    assert percentile(values, 99) == 10.0  # rank ceil(9.9) = 10
    assert percentile(values, 100) == 10.0
    assert percentile(values, 0.1) == 1.0
    assert Percentiles.of([4.0]) == Percentiles(4.0, 4.0, 4.0)
    assert Percentiles.of(list(range(1, 101))) == Percentiles(50, 90, 99)


def test_percentiles_refuse_what_is_undefined() -> None:
    with pytest.raises(ShardlineError, match="percentile of no values is undefined"):
        percentile([], 50)
    for p in (0, -1, 100.5):
        with pytest.raises(ShardlineError, match=r"must be in \(0, 100\]"):
            percentile([1.0], p)


def test_a_request_record_gives_its_latencies() -> None:
    r = RECORDS[0]
    assert (r.ttft_s, r.jct_s, r.tpot_s) == (0.5, 2.5, 0.5)
    assert RECORDS[3].tpot_s is None


@pytest.mark.parametrize(("args", "message"), [
    ((1.0, 0.5, 2.0, 3), "arrive, then give its first token, then finish"),
    ((0.0, 2.0, 1.0, 3), "arrive, then give its first token, then finish"),
    ((0.0, 0.5, float("nan"), 3), "times must be finite"),
    ((0.0, 0.5, 1.0, 0), "at least one token, got 0"),
])
def test_impossible_records_are_refused(args: tuple[float, float, float, int], message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        RequestRecord(*args)


def test_a_slo_needs_both_targets_met() -> None:
    assert [SLO.met(r) for r in RECORDS] == [False, True, False, True]
    for bad in ((0.0, 1.0), (1.0, -1.0), (float("inf"), 1.0)):
        with pytest.raises(ShardlineError, match="SLO targets must be positive finite seconds"):
            Slo(*bad)


def test_overlapping_busy_intervals_count_once() -> None:
    assert merged_seconds([]) == 0.0
    assert merged_seconds([(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (6.0, 7.0)]) == 5.0  # [0,3] + [5,7]
    assert merged_seconds([(0.0, 10.0), (2.0, 3.0), (4.0, 4.0)]) == 10.0  # nested and empty add nothing
    assert merged_seconds([(1.0, 2.0), (1.0, 2.0)]) == 1.0
    with pytest.raises(ShardlineError, match=r"start <= end, got \(3.0, 1.0\)"):
        merged_seconds([(3.0, 1.0)])


def test_busy_time_is_clipped_to_the_window_and_summed_over_instances() -> None:
    # prefill-0: [0,3] = 3; decode-0: [2,4.5] and [4,7] clipped to [2,5] = 3; decode-1: 0.
    assert instance_seconds_busy(BUSY, (0.0, 5.0)) == 6.0
    assert instance_seconds_busy({"a": [(-2.0, 1.0), (8.0, 9.0)]}, (0.0, 5.0)) == 1.0
    with pytest.raises(ShardlineError, match="busy interval must be finite"):
        instance_seconds_busy({"a": [(float("nan"), 1.0)]}, (0.0, 5.0))


def test_summary_of_a_small_run() -> None:
    s = summarize(RECORDS, BUSY, instances=4, slo=SLO)
    assert (s.requests, s.tokens, s.duration_s) == (4, 24, 5.0)  # window: 0 (first arrival) to 5 (last finish)
    assert s.ttft_s == Percentiles(0.25, 2.0, 2.0)  # sorted 0.125, 0.25, 0.5, 2
    assert s.jct_s == Percentiles(1.25, 3.0, 3.0)  # sorted 0.125, 1.25, 2.5, 3
    assert s.tpot_s == Percentiles(0.125, 0.5, 0.5)  # sorted 0.125, 0.125, 0.5 (the 1-token request has none)
    assert s.throughput_tps == 24 / 5
    assert s.goodput_rps == 2 / 5 and s.slo_attainment == 0.5  # only the requests meeting both targets
    assert (s.busy_instance_s, s.provisioned_instance_s) == (6.0, 20.0)
    assert s.tokens_per_busy_instance_s == 4.0 and s.tokens_per_provisioned_instance_s == 1.2


def test_summary_as_a_json_line() -> None:
    d = summarize(RECORDS, BUSY, instances=3, slo=SLO).as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["requests"] == 4 and d["slo_ttft_s"] == 1.0 and d["slo_tpot_s"] == 0.25
    assert (d["ttft_p50_s"], d["jct_p90_s"], d["tpot_p99_s"]) == (0.25, 3.0, 0.5)
    assert d["goodput_rps"] == 0.4 and d["provisioned_instance_s"] == 15.0
    assert d["tokens_per_provisioned_instance_s"] == 1.6
    rounded = summarize([RequestRecord(0.0, 0.1, 3.0, 2)], {"a": [(0.0, 3.0)]}, 1, SLO).as_dict()
    assert rounded["throughput_tps"] == 0.6667 and rounded["tpot_p50_s"] == 2.9


@pytest.mark.parametrize(("records", "busy", "instances", "message"), [
    ([], BUSY, 3, "no completed requests to summarize"),
    ([RequestRecord(1.0, 1.0, 1.0, 1)], BUSY, 3, "the run lasted no time"),
    (RECORDS, BUSY, 2, "2 instances provisioned, but 3 have busy intervals"),
    (RECORDS, {}, 0, "0 instances provisioned"),
    (RECORDS, {"a": [(6.0, 8.0)]}, 1, "no instance was busy during the run"),
    ([RequestRecord(0.0, 1.0, 1.0, 1)], {"a": [(0.0, 1.0)]}, 1, "no request generated two tokens"),
])
def test_degenerate_runs_are_refused(records: list[RequestRecord], busy: dict[str, list[tuple[float, float]]],
                                     instances: int, message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        summarize(records, busy, instances, SLO)
