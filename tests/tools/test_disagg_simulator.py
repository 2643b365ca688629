"""The serving simulator and its cost model: hand-checked timings, determinism, conservation,
the qualitative effect disaggregation exists for, and the costs file's fit and refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shardline_tools.sim.costs import Costs
from shardline_tools.sim.metrics import Slo, merged_seconds
from shardline_tools.sim.simulator import MAX_PREFILLS, MAX_ROWS, CoupledConfig, SimResult, simulate_coupled
from shardline_tools.sim.simulator_disagg import DisaggConfig, Transfer, from_length, simulate_disaggregated
from shardline_tools.sim.workloads import RequestSpec, Workload, generate

from shardline.config import COMPACT_AT, DEFAULT_PREFILL_CHUNK
from shardline.disagg.instance import Admission, FlipConfig
from shardline.disagg.predictor import NoisyOracle, Oracle
from shardline.disagg.state import Role
from shardline.errors import ShardlineError

# Round figures so every expected time below is a short sum.
C = Costs(prefill_base_s=0.01, prefill_token_s=0.001, prefill_token_ctx_s=1e-6, decode_base_s=0.01,
          decode_row_s=0.002, decode_row_ctx_s=1e-5, transfer_latency_s=0.005, transfer_bytes_per_s=1e6,
          merge_bytes_per_s=1e7, drop_bytes_per_s=1e8, kv_bytes_per_token=1000, kv_tokens=100_000, source="test")
oracle = from_length(Oracle(100, 10))


def spec(i: int, arrival: float, prompt: int, decode: int) -> RequestSpec:
    return RequestSpec(i, arrival, prompt, decode, "LPLD")


def one(result: SimResult, i: int = 0) -> tuple[float, float]:
    r = result.records[i]
    return r.ttft_s, r.jct_s


# --- coupled


def test_one_request_on_an_idle_coupled_instance() -> None:
    res = simulate_coupled([spec(0, 1.0, 300, 5)], C, CoupledConfig(instances=1))
    ttft = C.prefill_s(128, 0) + C.prefill_s(128, 128) + C.prefill_s(44, 256)  # the engine pads nothing
    jct = ttft + sum(C.decode_s(1, 300 + k) for k in range(1, 5))  # token k feeds at context 300 + k
    assert one(res) == pytest.approx((ttft, jct), abs=1e-12)
    assert res.records[0].tokens == 5


def test_a_running_stream_waits_for_another_prompts_chunks() -> None:
    """A (1 chunk) and B (3 chunks) arrive together: each iteration runs A's decode step, then
    B's next chunk, as the real scheduler plans them; B joins A's group once prefilled."""
    a, b = spec(0, 0.0, 100, 4), spec(1, 0.0, 300, 2)
    res = simulate_coupled([a, b], C, CoupledConfig(instances=1))
    t1 = C.prefill_s(100, 0)  # A's prompt, then B's first chunk, in the same iteration
    t2 = t1 + C.prefill_s(128, 0)
    t3 = t2 + C.decode_s(1, 101) + C.prefill_s(128, 128)
    t4 = t3 + C.decode_s(1, 102) + C.prefill_s(44, 256)  # B's first token
    end = t4 + C.merge_s(2, 301) + C.decode_s(2, 301)  # B merged into A's row, padded to B's width
    assert (res.records[0].first_token_s, res.records[0].finish_s) == pytest.approx((t1, end), abs=1e-12)
    assert (res.records[1].first_token_s, res.records[1].finish_s) == pytest.approx((t4, end), abs=1e-12)
    alone = simulate_coupled([a], C, CoupledConfig(instances=1)).records[0]
    assert alone.finish_s == pytest.approx(t1 + sum(C.decode_s(1, 100 + k) for k in (1, 2, 3)), abs=1e-12)
    assert res.records[0].finish_s - alone.finish_s > 0.3  # B's chunks sat between A's tokens


def test_coupled_routes_to_the_fewest_requests_and_limits_streams() -> None:
    specs = [spec(i, 0.0, 50, 3) for i in range(3)]
    res = simulate_coupled(specs, C, CoupledConfig(instances=2))
    assert sorted(len(v) > 0 for v in res.busy.values()) == [True, True]
    # One stream at a time: the second waits for the first to finish, then prefills.
    limited = simulate_coupled(specs[:2], C, CoupledConfig(instances=1, max_streams=1)).records
    assert limited[1].first_token_s == pytest.approx(limited[0].finish_s + C.prefill_s(50, 0), abs=1e-12)


def test_coupled_admits_only_what_its_kv_holds() -> None:
    """Two prompts of 300 on 500 KV tokens: the second waits until the first has finished (its KV
    freed), then prefills; before, a coupled instance ignored `Costs.kv_tokens` and ran both, on
    memory a decode instance of the same costs does not have."""
    costs = Costs(**{**C.__dict__, "kv_tokens": 500})
    a, b = spec(0, 0.0, 300, 5), spec(1, 0.0, 300, 2)
    res = simulate_coupled([a, b], costs, CoupledConfig(instances=1))
    prefill = C.prefill_s(128, 0) + C.prefill_s(128, 128) + C.prefill_s(44, 256)
    assert res.records[1].first_token_s == pytest.approx(res.records[0].finish_s + prefill, abs=1e-12)
    both = simulate_coupled([a, b], C, CoupledConfig(instances=1))  # 100,000 KV tokens: side by side
    assert both.records[1].first_token_s < both.records[0].finish_s


def test_coupled_reports_a_stream_outgrowing_its_kv_and_refuses_one_that_never_fits() -> None:
    costs = Costs(**{**C.__dict__, "kv_tokens": 500})
    res = simulate_coupled([spec(0, 0.0, 300, 300)], costs, CoupledConfig(instances=1))
    assert res.kv_overflow_peak == 300 + 299 - 500  # its last step began at context 599; none is evicted
    assert simulate_coupled([spec(0, 0.0, 300, 5)], costs, CoupledConfig(instances=1)).kv_overflow_peak == 0
    with pytest.raises(ShardlineError, match="can never start"):
        simulate_coupled([spec(0, 0.0, 501, 2)], costs, CoupledConfig(instances=1))


def test_regrouping_a_decode_group_costs_what_the_engine_copies() -> None:
    """A (prompt 400) joins B's group (prompt 50) and ends first: its join copies both rows at
    A's width, its departure drops a row, and the next plain step compacts B's row, which then
    wastes more than COMPACT_AT slots."""
    a, b = spec(0, 0.0, 400, 3), spec(1, 0.0, 50, 10)
    res = simulate_coupled([a, b], C, CoupledConfig(instances=1))
    t = C.prefill_s(128, 0) + C.prefill_s(50, 0)  # A's first chunk, B's whole prompt
    t += C.decode_s(1, 51) + C.prefill_s(128, 128)  # B alone in the group: it took its own state
    t += C.decode_s(1, 52) + C.prefill_s(128, 256)
    t += C.decode_s(1, 53) + C.prefill_s(16, 384)  # A's first token
    t += C.merge_s(2, 401) + C.decode_s(2, 401)  # A joins: a copy of both rows, 401 slots wide
    t += C.decode_s(2, 402)  # A's last token
    assert res.records[0].finish_s == pytest.approx(t, abs=1e-12)
    t += C.drop_s(1, 403) + C.decode_s(1, 403)  # A's row dropped; B's row is still 403 wide
    t += C.drop_s(1, 404) + C.decode_s(1, 57)  # 404 - 57 >= COMPACT_AT: compacted to B's 57
    t += C.decode_s(1, 58) + C.decode_s(1, 59)
    assert res.records[1].finish_s == pytest.approx(t, abs=1e-12)


def test_a_group_stays_as_wide_as_its_widest_row_was() -> None:
    """As above with A's prompt 150: B's row wastes 99 < COMPACT_AT slots once A has left, so the
    state is never compacted and B's steps pay for A's width to the end."""
    a, b = spec(0, 0.0, 150, 3), spec(1, 0.0, 50, 8)
    res = simulate_coupled([a, b], C, CoupledConfig(instances=1))
    t = C.prefill_s(128, 0) + C.prefill_s(50, 0)
    t += C.decode_s(1, 51) + C.prefill_s(22, 128)  # A's first token
    t += C.merge_s(2, 151) + C.decode_s(2, 151) + C.decode_s(2, 152)
    t += C.drop_s(1, 153) + C.decode_s(1, 153)
    t += C.decode_s(1, 154) + C.decode_s(1, 155) + C.decode_s(1, 156)
    assert COMPACT_AT > 156 - (50 + 7)
    assert res.records[1].finish_s == pytest.approx(t, abs=1e-12)


def test_the_real_engines_defaults() -> None:
    from shardline.serving.groups import MAX_ROWS as ENGINE_ROWS
    from shardline.serving.scheduler import SchedulerConfig

    assert ENGINE_ROWS == MAX_ROWS and SchedulerConfig().max_prefills == MAX_PREFILLS
    assert SchedulerConfig().compact_at == COMPACT_AT
    assert CoupledConfig().chunk == DisaggConfig().chunk == SchedulerConfig().chunk == DEFAULT_PREFILL_CHUNK


# --- disaggregated


def test_disaggregated_ttft_excludes_the_transfer_and_jct_includes_it() -> None:
    res = simulate_disaggregated([spec(0, 0.5, 300, 3)], C, oracle, DisaggConfig())
    ttft = C.prefill_s(128, 0) + C.prefill_s(128, 128) + C.prefill_s(128, 256)  # padded to 128
    move = C.transfer_s(300 * 1000)
    jct = ttft + move + C.decode_s(1, 301) + C.decode_s(1, 302)
    assert one(res) == pytest.approx((ttft, jct), abs=1e-12)


def test_chunk_level_transfer_hides_all_but_the_last_chunk() -> None:
    s = [spec(0, 0.0, 300, 3)]
    request = simulate_disaggregated(s, C, oracle, DisaggConfig(transfer=Transfer.REQUEST))
    chunked = simulate_disaggregated(s, C, oracle, DisaggConfig(transfer=Transfer.CHUNK))
    ttft = one(request)[0]
    assert one(chunked)[0] == pytest.approx(ttft, abs=1e-12)
    # 128 tokens' KV (0.133 s) moves faster than a chunk prefills (0.17 s): only the last one adds.
    assert C.transfer_s(128 * 1000) < C.prefill_s(128, 128)
    decode = C.decode_s(1, 301) + C.decode_s(1, 302)
    assert one(chunked)[1] == pytest.approx(ttft + C.transfer_s(44 * 1000) + decode, abs=1e-12)
    assert one(chunked)[1] < one(request)[1]


def test_reserve_static_delays_what_vanilla_admits() -> None:
    """A holds 400 + up to 300 of 1000 KV tokens, predicted to grow by 300; B's prompt of 350 fits
    the free slots now (vanilla) but not beside A's predicted growth (reserve-static). Both
    growing, they outgrow the 1000 slots: the risk vanilla takes."""
    costs = Costs(**{**C.__dict__, "kv_tokens": 1000})
    specs = [spec(0, 0.0, 400, 300), spec(1, 0.0, 350, 250)]
    runs = {p: simulate_disaggregated(specs, costs, oracle, DisaggConfig(admission=p))
            for p in (Admission.VANILLA, Admission.RESERVE_STATIC)}
    vanilla, static = (runs[p].records for p in (Admission.VANILLA, Admission.RESERVE_STATIC))
    assert vanilla[1].ttft_s == static[1].ttft_s  # same prefill either way
    assert vanilla[1].finish_s < vanilla[0].finish_s  # B decoded beside A
    assert static[1].finish_s > static[0].finish_s  # B waited until A had finished
    assert runs[Admission.VANILLA].kv_overflow_peak > 0  # the bet vanilla takes: past capacity
    assert runs[Admission.RESERVE_STATIC].kv_overflow_peak == 0


def test_global_scheduler_counts_what_it_sent_since_the_monitors_reading() -> None:
    """A burst inside one monitor period: the state gathered at 0 shows both prefill instances
    idle, and what the scheduler sent since is added (as front.py does), so the burst alternates
    between them instead of piling onto the first."""
    burst = [spec(i, 0.01 * (i + 1), 200, 2) for i in range(4)]  # all inside the first period
    res = simulate_disaggregated(burst, C, oracle, DisaggConfig(prefill=2))
    assert len(res.busy["i000"]) == len(res.busy["i001"]) == 4  # two prompts of two chunks each


def test_a_request_that_can_never_start_is_an_error() -> None:
    costs = Costs(**{**C.__dict__, "kv_tokens": 100})
    with pytest.raises(ShardlineError, match="can never start"):
        simulate_disaggregated([spec(0, 0.0, 200, 5)], costs, oracle)
    with pytest.raises(ShardlineError, match="not a LengthRange"):
        simulate_disaggregated([spec(0, 0.0, 20, 5)], C, lambda s: 3)  # type: ignore[arg-type,return-value]


# --- whole runs


def _mixed(rate: float, n: int = 120, seed: int = 1) -> list[RequestSpec]:
    return generate(Workload("Mixed", n, rate, seed=seed))


def _check_conserved(specs: list[RequestSpec], res: SimResult) -> None:
    assert len(res.records) == len(specs)
    for s, r in zip(specs, res.records, strict=True):
        assert (r.arrival_s, r.tokens) == (s.arrival_s, s.decode_tokens)
    end = max(r.finish_s for r in res.records)
    for spans in res.busy.values():
        ordered = sorted(spans)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(ordered, ordered[1:], strict=False))  # one step at a time
        assert merged_seconds(spans) <= end
    summary = res.summary(Slo(1.0, 0.1))
    assert summary.busy_instance_s <= summary.provisioned_instance_s + 1e-9


def test_every_request_finishes_once_with_its_tokens() -> None:
    specs = _mixed(2.0)
    _check_conserved(specs, simulate_coupled(specs, Costs()))
    for cfg in (DisaggConfig(prefill=2, decode=2, transfer=Transfer.CHUNK, admission=Admission.RESERVE_DYNAMIC),
                DisaggConfig(prefill=1, decode=3, flip=FlipConfig(idle_s=0.3, pressure=1.0))):
        _check_conserved(specs, simulate_disaggregated(specs, Costs(), oracle, cfg))


def test_flips_move_idle_decode_instances_to_a_swamped_prefill() -> None:
    specs = generate(Workload("HPLD", 60, 2.0, seed=3))
    cfg = DisaggConfig(prefill=1, decode=3, flip=FlipConfig(idle_s=0.3, pressure=1.0))
    flipped = simulate_disaggregated(specs, Costs(), oracle, cfg)
    fixed = simulate_disaggregated(specs, Costs(), oracle, DisaggConfig(prefill=1, decode=3))
    assert fixed.flips == () and any(f.role is Role.PREFILL for f in flipped.flips)
    slo = Slo(1.0, 0.1)
    assert flipped.summary(slo).ttft_s.p50 < fixed.summary(slo).ttft_s.p50


def test_a_run_is_determined_by_its_inputs_and_seed() -> None:
    specs = _mixed(2.0)

    def run(seed: int) -> SimResult:
        noisy = NoisyOracle(100, 10, seed=7, accuracy=0.75)  # draws in call order: the same each run
        cfg = DisaggConfig(prefill=2, decode=3, seed=seed)
        return simulate_disaggregated(specs, Costs(), from_length(noisy), cfg)

    assert run(5) == run(5)
    assert simulate_coupled(specs, Costs()) == simulate_coupled(specs, Costs())


def test_disaggregation_keeps_decodes_clear_of_prefill() -> None:
    """Mixed at 1.5 requests/s on two instances: coupled instances stall their decodes behind
    heavy prompts' chunks; a decode instance only decodes. Equal hardware: 2 coupled vs 1P + 1D."""
    specs = _mixed(1.5, n=200)
    slo = Slo(1.0, 0.1)
    free = Costs(merge_bytes_per_s=1e15, drop_bytes_per_s=1e15)  # regrouping set aside: interference alone
    coupled = simulate_coupled(specs, free, CoupledConfig(instances=2)).summary(slo)
    disagg = simulate_disaggregated(specs, free, oracle, DisaggConfig(prefill=1, decode=1)).summary(slo)
    assert disagg.tpot_s.p50 < 0.8 * coupled.tpot_s.p50


# --- costs


def _samples(c: Costs, rng: np.random.Generator, noise: float = 0.0) -> dict[str, Any]:
    def jitter(v: float) -> float:
        return v * (1 + noise * rng.standard_normal())

    prefill = [(n, ctx, jitter(c.prefill_s(n, ctx))) for n in (16, 64, 128, 256) for ctx in (0, 512, 2048)]
    decode = [(r, ctx, jitter(c.decode_s(r, ctx))) for r in (1, 2, 4, 8) for ctx in (64, 256, 1024)]
    transfer = [(b, jitter(c.transfer_s(b))) for b in (1 << 16, 1 << 20, 1 << 24)]
    merges = [(c.kv_bytes(r * w), jitter(c.merge_s(r, w))) for r in (2, 4) for w in (256, 1024)]
    drops = [(c.kv_bytes(r * w), jitter(c.drop_s(r, w))) for r in (1, 3) for w in (256, 1024)]
    return {"prefill": prefill, "decode": decode, "transfer": transfer, "merges": merges, "drops": drops}


def test_fit_recovers_known_coefficients() -> None:
    got = Costs.fit(**_samples(C, np.random.default_rng(0)), kv_bytes_per_token=1000, kv_tokens=100_000)
    for name in ("prefill_base_s", "prefill_token_s", "prefill_token_ctx_s", "decode_base_s", "decode_row_s",
                 "decode_row_ctx_s", "transfer_latency_s", "transfer_bytes_per_s", "merge_bytes_per_s",
                 "drop_bytes_per_s"):
        assert getattr(got, name) == pytest.approx(getattr(C, name), rel=1e-6), name
    assert "35 measured samples" in got.source
    without = {k: v for k, v in _samples(C, np.random.default_rng(0)).items() if k not in ("merges", "drops")}
    assert Costs.fit(**without).merge_bytes_per_s == Costs().merge_bytes_per_s  # none measured: the default


def test_fit_keeps_every_coefficient_non_negative() -> None:
    flat = Costs(**{**C.__dict__, "prefill_token_ctx_s": 0.0, "decode_row_ctx_s": 0.0})
    got = Costs.fit(**_samples(flat, np.random.default_rng(1), noise=0.02))
    assert min(getattr(got, f) for f in ("prefill_token_ctx_s", "decode_row_ctx_s")) >= 0
    assert got.prefill_token_s == pytest.approx(flat.prefill_token_s, rel=0.1)


@pytest.mark.parametrize("change, match", [
    ({"prefill": [(128, 0, 0.1)]}, "at least 3 samples"),
    ({"prefill": [(n, 0, 0.01 * n) for n in (1, 2, 3, 4)]}, "do not vary enough"),
    ({"decode": [(r, 64, math.nan) for r in (1, 2, 4, 8)]}, "finite"),
    ({"transfer": [(1000, 0.01), (2000, 0.01), (3000, 0.01)]}, "does not grow with bytes"),
    ({"transfer": [(1000, -0.01), (2000, 0.01)]}, "non-negative"),
    ({"merges": [(1000, 0.0), (2000, 0.0)]}, "merge_bytes_per_s needs samples of positive bytes and time"),
    ({"drops": [(0, 0.01)]}, "drop_bytes_per_s needs samples of positive bytes"),
])
def test_fit_refuses_samples_it_cannot_use(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ShardlineError, match=match):
        Costs.fit(**{**_samples(C, np.random.default_rng(0)), **change})


def test_costs_json_round_trip_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    C.to_json(path)
    Costs().to_json(path)  # replaced whole
    assert Costs.from_json(path) == Costs()
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]  # no temporary file left


def _doc(**change: object) -> dict[str, Any]:
    fields = {k: v for k, v in Costs().__dict__.items() if k != "prefill_knee_tokens"}  # not in version 2
    doc = json.loads(json.dumps({"format": "shardline-disagg-costs", "version": 2, **fields}))
    doc.update(change)
    return doc


@pytest.mark.parametrize("doc, match", [
    ({k: v for k, v in _doc().items() if k != "decode_row_s"}, "missing \\['decode_row_s'\\]"),
    (_doc(extra=1), "unknown \\['extra'\\]"),
    (_doc(prefill_base_s=-0.01), "prefill_base_s must be a finite number >= 0"),
    (_doc(decode_base_s="0.01"), "decode_base_s must be a finite number"),
    (_doc(decode_base_s=True), "decode_base_s must be a finite number"),
    (_doc(kv_tokens=1.5), "kv_tokens must be an integer"),
    (_doc(kv_bytes_per_token=0), "kv_bytes_per_token must be an integer >= 1"),
    (_doc(transfer_bytes_per_s=0), "transfer_bytes_per_s must be > 0"),
    (_doc(prefill_base_s=0, prefill_token_s=0), "must each cost some time"),
    (_doc(source=["x"]), "source must be a string"),
    (_doc(version=1), "not a shardline-disagg-costs file of version 2"),
    (_doc(merge_bytes_per_s=0), "merge_bytes_per_s must be > 0"),
    ([1, 2], "not a JSON object"),
])
def test_from_json_refuses_bad_fields(tmp_path: Path, doc: object, match: str) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ShardlineError, match=match):
        Costs.from_json(path)


@pytest.mark.parametrize("text, match", [
    ('"decode_row_ctx_s": NaN', "must be a finite number"),
    ('"decode_row_ctx_s": Infinity', "must be a finite number"),
    ('"decode_row_ctx_s": 1' + "0" * 400, "must be a finite number"),
])
def test_from_json_refuses_non_finite_numbers(tmp_path: Path, text: str, match: str) -> None:
    good = json.dumps(_doc(decode_row_ctx_s=0.5))
    path = tmp_path / "costs.json"
    path.write_text(good.replace('"decode_row_ctx_s": 0.5', text))
    with pytest.raises(ShardlineError, match=match):
        Costs.from_json(path)


@pytest.mark.parametrize("data", [b'{"format": "shardline-disagg-co', b"\xff\xfe{}", b"[" * 100_000,
                                  b" " * ((1 << 20) + 1)])
def test_from_json_refuses_corrupt_files(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "costs.json"
    path.write_bytes(data)
    with pytest.raises(ShardlineError, match="costs"):
        Costs.from_json(path)
    with pytest.raises(ShardlineError, match="cannot read"):
        Costs.from_json(tmp_path / "missing.json")


def test_a_chunk_below_the_knee_costs_as_one_of_the_knee() -> None:
    knee = Costs(**{**C.__dict__, "prefill_knee_tokens": 512})
    assert knee.prefill_s(64, 100) == knee.prefill_s(512, 100) == C.prefill_s(512, 100)
    assert knee.prefill_s(600, 100) == C.prefill_s(600, 100)  # past it, linear as before
    assert Costs().prefill_knee_tokens == 0 and C.prefill_s(64, 0) < C.prefill_s(512, 0)  # off by default


@pytest.mark.parametrize("knee", [-1, 1.5, True, "512"])
def test_the_knee_must_be_a_whole_number_of_positions(knee: object) -> None:
    with pytest.raises(ShardlineError, match="prefill_knee_tokens must be an integer >= 0"):
        Costs(prefill_knee_tokens=knee)  # type: ignore[arg-type]


def test_costs_files_keep_version_2_without_a_knee_and_say_3_with_one(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    C.to_json(path)
    old = json.loads(path.read_text())
    assert old["version"] == 2 and "prefill_knee_tokens" not in old  # what older readers take
    assert list(old)[2:] == [k for k in C.__dict__ if k != "prefill_knee_tokens"]
    assert Costs.from_json(path) == C
    knee = Costs(**{**C.__dict__, "prefill_knee_tokens": 512})
    knee.to_json(path)
    assert json.loads(path.read_text())["version"] == 3
    assert Costs.from_json(path) == knee
    path.write_text(json.dumps(_doc()))  # a file written before the knee existed: no knee
    assert Costs.from_json(path) == Costs()


@pytest.mark.parametrize("doc, match", [
    (_doc(prefill_knee_tokens=512), "unknown \\['prefill_knee_tokens'\\]"),  # version 2 had no knee
    (_doc(version=3), "missing \\['prefill_knee_tokens'\\]"),
    (_doc(version=3, prefill_knee_tokens=-5), "prefill_knee_tokens must be an integer >= 0"),
    (_doc(version=4, prefill_knee_tokens=0), "not a shardline-disagg-costs file of version 2 or 3"),
])
def test_from_json_checks_the_knee_by_version(tmp_path: Path, doc: object, match: str) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ShardlineError, match=match):
        Costs.from_json(path)


def test_default_costs_match_the_benchmarks_they_come_from() -> None:
    d = Costs()
    assert d.kv_bytes_per_token == 46080
    assert d.decode_s(1, 400) == pytest.approx(0.0144, rel=0.01)  # issue 10: a one-row step
    speedups = [r * d.decode_s(1, 256) / d.decode_s(r, 256) for r in (2, 4, 8)]
    assert speedups == pytest.approx([1.67, 2.75, 3.18], rel=0.1)  # issue 4 batching table
    assert 128 / d.prefill_s(128, 0) == pytest.approx(773, rel=0.1)  # issue 9 (a): 128 tokens in one chunk
