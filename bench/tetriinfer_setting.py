"""TetriInfer's own setting, SIMULATED (issue 22, point 4): does our implementation of its design
reproduce its direction on a cost model of its testbed, OPT-13B on one V100 per instance?

Nothing is measured on this machine. The cost model (`opt13b_v100`) is built from published
figures, each cited in FIGURES below; where no measured figure exists it is DERIVED by roofline
(bytes over bandwidth for a decode step, FLOPs over a measured GEMM rate for prefill), and says so.

    TetriInfer: Hu et al., "Inference without Interference: Disaggregate LLM Inference for Mixed
    Downstream Workloads", arXiv:2401.11181 (v1, 2024-01-20).

The paper's policies, as far as the simulator has them (shardline_tools/sim/simulator_disagg.py):
- prefill: fixed 512-token chunks (its saturation point for OPT-13B on a V100), each prompt's
  last chunk padded; FCFS or SJF over PrefillSchedBatch = 16; the least-loaded prefill instance;
- length predictor: buckets of g = 200 tokens at the paper's 74.9% accuracy, simulated by
  predictor.NoisyOracle (right bucket with p = 0.749, else a neighbouring one), not a trained model;
- dispatch: power of two among the decode instances with room, lower heavy:light ratio;
- decode: reserve-dynamic admission on the low end of the predicted bucket; continuous batching,
  all running streams in one step (max 256, vLLM's max_num_seqs default); request-level KV transfer.
- light/heavy: prompts <= 512 / > 512 tokens, decodes <= 128 / > 128 generated tokens (the paper's
  thresholds); the ranges' outer bounds are ours (THRESHOLDS below), uniform within each range.

The baseline ("vLLM-style coupled serving", as the paper compares against): N instances, each
request to the least-loaded one, whole prompts (no chunking, as vLLM had none in January 2024),
every admitted prompt prefilled before the next decode step (vLLM's prefill-first scheduler),
all decoding streams in one batched step, admission while the prompt's KV fits (vanilla).
Cluster shape: the paper's instance counts could not be retrieved from the stored copies of the
paper here, so equal GPUs are compared (1 prefill + 1 decode against 2 coupled, 2 + 2 against 4;
at 4, also with instance flips at FlipConfig's defaults), and, marked "unequal", 1 + 1 against ONE
coupled GPU: the other reading of a 1P+1D system measured against vLLM.

Where the simulator differs from the paper's systems (read the figures with these in mind):
- KV waiting at a decode instance for admission is held nowhere: a prefill instance never stops
  for memory, so under overload the wait moves from before the first token to after it;
- neither side preempts: a stream outgrowing the KV capacity runs on (the peak past it is
  reported); vLLM would preempt and recompute, TetriInfer's reservations exist to avoid that;
- every prompt is prefilled on its own (a short one costs a whole knee-sized step on both sides),
  where vLLM batches waiting prompts into one step and TetriInfer may pack them into one chunk;
- a decode step charges every row at the group's widest context (our engine's padded state),
  where paged attention reads each row's own context; the same on both sides.

Arrivals: Poisson, the same for both systems, at `--load` times what the coupled side serves by
the cost model (`rate_for`). A sensitivity table follows: Mixed and HPHD against the load, with
the paper's knee and with the roofline's (`roofline_knee`). Every figure printed is SIMULATED.

    python bench/tetriinfer_setting.py --quick    # smoke, about a second
    python bench/tetriinfer_setting.py            # every class and shape, FCFS and SJF, the sweep

The last line on stdout is one JSON object: the disaggregated/coupled ratios first, then the
paper's published direction, the absolute simulated figures and the cost model.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from shardline_tools.sim.costs import Costs
from shardline_tools.sim.metrics import Slo
from shardline_tools.sim.simulator import CoupledConfig, SimResult, simulate_coupled
from shardline_tools.sim.simulator_disagg import DisaggConfig, Transfer, from_length, simulate_disaggregated
from shardline_tools.sim.workloads import KINDS, RequestSpec, Thresholds, Workload, generate

from shardline.disagg.instance import Admission, FlipConfig
from shardline.disagg.policies import PrefillPolicy
from shardline.disagg.predictor import NoisyOracle

# --- the model: OPT-13B (facebook/opt-13b config.json; the vLLM paper, arXiv:2309.06180, section 3)
LAYERS, HIDDEN, FFN, VOCAB, POSITIONS = 40, 5120, 20480, 50272, 2050  # OPT's learned positions: 2048 + 2
LAYER_PARAMS = LAYERS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN + FFN + 9 * HIDDEN)  # attn, MLP, biases, 2 LNs
PARAMS = LAYER_PARAMS + (VOCAB + POSITIONS) * HIDDEN + 2 * HIDDEN  # + embeddings (tied lm_head), final LN
WEIGHT_BYTES = 2 * PARAMS  # fp16: ~25.7 GB, vLLM's "26GB" for a 13B model
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN * 2  # (k, v) x layers x hidden x fp16 = 819,200 B ("800 KB", vLLM)
CONTEXT = 2048

# --- the device: one Tesla V100-SXM2-32GB
V100_PEAK_TFLOPS = 125.0  # fp16 tensor cores, NVIDIA V100 datasheet (SXM2)
V100_GEMM_TFLOPS = 775.1 / 8  # measured: 8192^3 fp16 GEMM on 8 V100-SXM2-32GB at default clocks (QuixiAI/nvdriver)
V100_PEAK_GBPS = 900.0  # HBM2, NVIDIA V100 datasheet
V100_STREAM_GBPS = 1041.7 / 1.262  # measured STREAM triad 1041.7 GB/s at a +26.2% HBM clock (nvdriver): ~825 at stock
V100_MEMORY = 32 * 2**30
NVLINK_GBPS = 40.05  # measured NVLink 2.0 unidirectional between two V100-SXM2 (nvdriver)
VLLM_MEMORY_SHARE = 0.9  # vLLM's default gpu_memory_utilization
ACTIVATION_RESERVE = 2**30  # ASSUMED: activations and workspace vLLM profiles and keeps out of the KV pool
PAPER_KNEE = 512  # TetriInfer: prefill saturates the V100 at 512 tokens for OPT-13B (its ChunkSize)

FIGURES = {
    "opt13b_shapes": "40 layers, hidden 5120, 40 heads, FFN 20480, vocab 50272, 2048 positions: "
                     "huggingface.co/facebook/opt-13b config.json",
    "kv_bytes_per_token": "2 x 40 x 5120 x 2 B = 819,200 B: vLLM paper (arXiv:2309.06180) section 3, '800 KB'",
    "weights": f"{PARAMS / 1e9:.2f} G params x 2 B = {WEIGHT_BYTES / 1e9:.1f} GB (vLLM paper Fig. 1: 26 GB)",
    "v100": "125 TFLOPS fp16 tensor, 900 GB/s HBM2, 32 GB: NVIDIA Tesla V100 datasheet (SXM2)",
    "v100_measured": "775.1 TFLOPS fp16 GEMM on 8 V100-SXM2-32GB (96.9 each), STREAM triad 1041.7 GB/s at a "
                     "+26.2% HBM clock (825 GB/s scaled to stock), NVLink 2.0 40.05 GB/s one way: "
                     "github.com/QuixiAI/nvdriver release v0.1.0",
    "knee": "prefill saturates at 512 tokens for OPT-13B on a V100, hence 512-token chunks, the last padded: "
            "TetriInfer arXiv:2401.11181 (abstract: fixed-size chunks keep the accelerator at its computation-"
            "saturated limit; the 512 for OPT-13B on its V100 as summarized in MISSION.md Part 2)",
    "decode_flat": "decode step nearly flat in its batch: DERIVED, the weight stream (25.7 GB / 825 GB/s = "
                   "31.1 ms) dominates; rows add their KV reads only (compute hides under the stream below "
                   "~117 rows = GEMM FLOPS / bandwidth)",
    "prefill_rate": "DERIVED: 2 x 12.59 G layer params / 96.9 TFLOPS = 0.260 ms per position at or past the knee; "
                    "attention 4 x 40 x 5120 FLOP per (position, cached token)",
    "capacity": "DERIVED: (0.9 x 32 GiB (vLLM gpu_memory_utilization) - 25.7 GB weights - 1 GiB ASSUMED "
                "activations) / 819,200 B",
    "transfer": "NVLink 2.0 between the two instances' GPUs, 40.05 GB/s measured (nvdriver); 1 ms setup ASSUMED",
    "regrouping": "free: vLLM's paged KV forms a batch from block tables, no copy",
}

# The paper's thresholds: heavy prompt > 512 tokens, heavy decode > 128 tokens. The outer bounds are
# ours (not published): the longest request, 1536 + 512, fills OPT-13B's 2048-token context.
THRESHOLDS = Thresholds(light_prompt=(32, 512), heavy_prompt=(513, 1536), light_decode=(8, 128),
                        heavy_decode=(129, 512), context=CONTEXT)
HEAVY_FROM = 129
G, BUCKETS, ACCURACY = 200, math.ceil(CONTEXT / 200), 0.749  # TetriInfer's predictor: 74.9% at g = 200
MAX_SEQS = 256  # vLLM's max_num_seqs default: streams one instance runs at once
SLO = Slo(ttft_s=5.0, tpot_s=0.2)  # only for summarize(); goodput is not compared here

# The paper's published direction (disaggregated / coupled), per class where it states one.
PAPER = {
    "Mixed": {"ttft_mean": 0.15, "jct_mean": 0.50, "note": "TTFT -85%, JCT -50%"},
    "HPHD": {"ttft_mean": 1.0, "jct_mean": 1.0, "note": "little or no gain"},
    "LPHD": {"perf_per_cost": 2.4, "note": "perf/$ 2.4x"},
    "average": {"ttft_mean": 0.03, "jct_mean": 0.53, "note": "abstract: TTFT -97%, JCT -47%, 38% less resource"},
}


def opt13b_v100(knee: int = PAPER_KNEE) -> Costs:
    """OPT-13B on one V100-SXM2-32GB (FIGURES). `knee` 512 is the paper's; the roofline's own
    knee, where a chunk's FLOPs outlast the weight stream, is `roofline_knee()`."""
    gemm, stream = V100_GEMM_TFLOPS * 1e12, V100_STREAM_GBPS * 1e9
    kv_pool = VLLM_MEMORY_SHARE * V100_MEMORY - WEIGHT_BYTES - ACTIVATION_RESERVE
    return Costs(
        prefill_base_s=0.0,  # per-step launch overheads: no published figure, left out
        prefill_token_s=2 * LAYER_PARAMS / gemm,
        prefill_token_ctx_s=4 * LAYERS * HIDDEN / gemm,
        decode_base_s=WEIGHT_BYTES / stream,
        decode_row_s=0.0,  # a row's FLOPs hide under the weight stream (FIGURES["decode_flat"])
        decode_row_ctx_s=KV_BYTES_PER_TOKEN / stream,
        transfer_latency_s=0.001,
        transfer_bytes_per_s=NVLINK_GBPS * 1e9,
        merge_bytes_per_s=1e15, drop_bytes_per_s=1e15,  # paged KV: regrouping copies nothing
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        kv_tokens=int(kv_pool // KV_BYTES_PER_TOKEN),
        prefill_knee_tokens=knee,
        source=f"OPT-13B on a V100-SXM2-32GB from published figures and roofline (bench/tetriinfer_setting.py), "
               f"knee {knee}",
    )


def roofline_knee() -> int:
    """Positions at which a chunk's GEMM time equals the weight stream: below it, a V100 is
    bandwidth-bound (DERIVED; the paper's measured saturation point is 512)."""
    c = opt13b_v100(0)
    return math.ceil(c.decode_base_s / c.prefill_token_s)


# --- runs


@dataclass(frozen=True)
class Shape:
    """One comparison: `prefill` + `decode` GPUs disaggregated against `coupled` coupled GPUs."""

    prefill: int
    decode: int
    coupled: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P+{self.decode}D v {self.coupled}C"

    @property
    def equal(self) -> bool:
        return self.prefill + self.decode == self.coupled


def parse_shapes(text: str) -> list[Shape]:
    shapes = [Shape(*(int(x) for x in part.split(":"))) for part in text.split(",")]
    if any(min(s.prefill, s.decode, s.coupled) < 1 for s in shapes):
        raise ValueError("every count must be >= 1")
    return shapes


def rate_for(specs: Sequence[RequestSpec], costs: Costs, gpus: int, load: float) -> float:
    """`load` times the requests per second `gpus` coupled instances serve by the cost model: a
    mean prompt's prefill plus a mean decode at the batch the KV capacity allows."""
    prompt = statistics.mean(s.prompt_tokens for s in specs)
    decode = statistics.mean(s.decode_tokens for s in specs)
    rows = max(1, min(MAX_SEQS, int(costs.kv_tokens // (prompt + decode))))
    per_request = costs.prefill_s(round(prompt), 0) + decode * costs.decode_s(rows, round(prompt + decode / 2)) / rows
    return load * gpus / per_request


def workload(kind: str, n: int, seed: int, costs: Costs, gpus: int, load: float) -> list[RequestSpec]:
    shape = generate(Workload(kind, n, 1.0, seed), THRESHOLDS)  # lengths do not depend on the rate
    return generate(Workload(kind, n, rate_for(shape, costs, gpus, load), seed), THRESHOLDS)


def coupled(specs: Sequence[RequestSpec], costs: Costs, shape: Shape) -> SimResult:
    """vLLM-style: whole prompts, every admitted one before the next decode step, one batch."""
    cfg = CoupledConfig(instances=shape.coupled, chunk=CONTEXT, max_prefills=MAX_SEQS, groups=1,
                        max_rows=MAX_SEQS, max_streams=MAX_SEQS)
    return simulate_coupled(specs, costs, cfg)


def disaggregated(specs: Sequence[RequestSpec], costs: Costs, shape: Shape, policy: PrefillPolicy, seed: int,
                  flips: bool = False) -> SimResult:
    """TetriInfer's policies (module docstring); `flips`: instance flip at FlipConfig's defaults."""
    cfg = DisaggConfig(prefill=shape.prefill, decode=shape.decode, chunk=PAPER_KNEE, pad_chunks=True, policy=policy,
                       transfer=Transfer.REQUEST, admission=Admission.RESERVE_DYNAMIC, heavy_from=HEAVY_FROM,
                       groups=1, max_rows=MAX_SEQS, max_streams=MAX_SEQS, flip=FlipConfig() if flips else None,
                       seed=seed)
    predict = from_length(NoisyOracle(G, BUCKETS, seed=seed, accuracy=ACCURACY))
    return simulate_disaggregated(specs, costs, predict, cfg)


def figures(res: SimResult) -> dict[str, float]:
    """Means and percentiles of TTFT and JCT, tokens per busy GPU-second, KV overflow."""
    s = res.summary(SLO)
    return {"ttft_mean": statistics.mean(r.ttft_s for r in res.records), "ttft_p50": s.ttft_s.p50,
            "ttft_p90": s.ttft_s.p90, "jct_mean": statistics.mean(r.jct_s for r in res.records),
            "jct_p50": s.jct_s.p50, "jct_p90": s.jct_s.p90, "tokens_per_busy_gpu_s": s.tokens_per_busy_instance_s,
            "kv_overflow_peak": res.kv_overflow_peak, "flips": len(res.flips)}


RATIOS = ("ttft_mean", "ttft_p50", "ttft_p90", "jct_mean", "jct_p50", "jct_p90")


def ratios(d: dict[str, float], c: dict[str, float]) -> dict[str, float]:
    out = {k: round(d[k] / c[k], 3) for k in RATIOS}
    out["perf_per_cost"] = round(d["tokens_per_busy_gpu_s"] / c["tokens_per_busy_gpu_s"], 3)
    return out


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def systems(shape: Shape, policies: Sequence[PrefillPolicy]) -> list[tuple[str, PrefillPolicy, bool]]:
    """The disaggregated variants run on `shape`: each policy, and FCFS with flips where a role
    has an instance to spare (the last of a role never flips)."""
    out = [(f"disagg {p.value}", p, False) for p in policies]
    if shape.prefill + shape.decode >= 3:
        out.append(("disagg fcfs+flip", PrefillPolicy.FCFS, True))
    return out


def run_class(kind: str, shape: Shape, policies: Sequence[PrefillPolicy], costs: Costs, requests: int,
              seeds: int, load: float) -> dict[str, dict[str, float]]:
    """Medians over seeds of each system's figures: "coupled" first, then the disaggregated ones."""
    runs: dict[str, list[dict[str, float]]] = {}
    for seed in range(seeds):
        specs = workload(kind, requests, seed, costs, shape.coupled, load)
        runs.setdefault("coupled", []).append(figures(coupled(specs, costs, shape)))
        for name, policy, flips in systems(shape, policies):
            runs.setdefault(name, []).append(figures(disaggregated(specs, costs, shape, policy, seed, flips)))
    return {name: median_of(r) for name, r in runs.items()}


def sweep(costs: Costs, requests: int, loads: Sequence[float]) -> dict[str, dict[str, float]]:
    """Mixed and HPHD, FCFS, one seed: the mean TTFT and JCT ratios against the load, for equal
    GPUs (1P+1D v 2C) and for 1P+1D v 1C, with the paper's knee and with the roofline's."""
    out: dict[str, dict[str, float]] = {}
    for knee in (PAPER_KNEE, roofline_knee()):
        c = replace(costs, prefill_knee_tokens=knee)
        for kind in ("Mixed", "HPHD"):
            for shape in (Shape(1, 1, 2), Shape(1, 1, 1)):
                for load in loads:
                    got = run_class(kind, shape, [PrefillPolicy.FCFS], c, requests, 1, load)
                    r = ratios(got["disagg fcfs"], got["coupled"])
                    out[f"{kind}|{shape.name}|load {load}|knee {knee}"] = {k: r[k] for k in ("ttft_mean", "jct_mean")}
    return out


# --- report


def print_costs(costs: Costs) -> None:
    print("SIMULATED: OPT-13B on one V100-SXM2-32GB per instance, cost model from published figures (no "
          "measurement on this machine)")
    print(f"  prefill: {costs.prefill_token_s * 1e3:.3f} ms per position, knee {costs.prefill_knee_tokens} "
          f"(a {PAPER_KNEE}-token chunk {costs.prefill_s(PAPER_KNEE, 0) * 1e3:.0f} ms, a 64-token one "
          f"{costs.prefill_s(64, 0) * 1e3:.0f} ms); the roofline's knee would be {roofline_knee()} positions")
    print(f"  decode step: {costs.decode_base_s * 1e3:.1f} ms + {costs.decode_row_ctx_s * 1e6:.2f} us per row per "
          f"position (1 row at 1024: {costs.decode_s(1, 1024) * 1e3:.1f} ms, 8 rows: "
          f"{costs.decode_s(8, 1024) * 1e3:.1f} ms)")
    print(f"  KV: {costs.kv_bytes_per_token} B per token, {costs.kv_tokens} tokens per instance; transfer "
          f"{costs.transfer_bytes_per_s / 1e9:.1f} GB/s + {costs.transfer_latency_s * 1e3:.0f} ms")
    for k, v in FIGURES.items():
        print(f"    [{k}] {v}")


def print_ratios(rows: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\nSIMULATED disaggregated / coupled (below 1: disaggregated better; perf/$ = tokens per busy "
          "GPU-second, above 1 better); 'unequal': 2 GPUs against 1")
    print(f"{'class':<6} {'GPUs':<20} {'system':<17}" + "".join(f"{k:>10}" for k in (*RATIOS, "perf/$"))
          + "  paper (published)")
    for key, variants in rows.items():
        kind, gpus = key.split("|")
        for name, r in variants.items():
            paper = PAPER.get(kind, {}).get("note", "")
            print(f"{kind:<6} {gpus:<20} {name:<17}" + "".join(f"{r[k]:>10.3f}" for k in (*RATIOS, "perf_per_cost"))
                  + f"  {paper}")


def print_absolute(absolute: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\nSIMULATED seconds (medians over seeds), tokens per busy GPU-second, KV overflow peak (tokens), flips")
    cols = (*RATIOS, "tokens_per_busy_gpu_s", "kv_overflow_peak", "flips")
    labels = (*RATIOS, "tok/busy_s", "kv_over", "flips")
    print(f"{'class':<6} {'GPUs':<20} {'system':<17}" + "".join(f"{k:>11}" for k in labels))
    for key, variants in absolute.items():
        kind, gpus = key.split("|")
        for name, f in variants.items():
            print(f"{kind:<6} {gpus:<20} {name:<17}" + "".join(f"{f[k]:>11.3f}" for k in cols))


def print_sweep(table: dict[str, dict[str, float]]) -> None:
    print("\nSIMULATED sensitivity, disaggregated (FCFS) / coupled, means: load and prefill knee")
    print(f"{'class':<6} {'GPUs':<20} {'load':>6} {'knee':>6} {'TTFT':>8} {'JCT':>8}")
    for key, r in table.items():
        kind, gpus, load, knee = key.split("|")
        print(f"{kind:<6} {gpus:<20} {load.split()[1]:>6} {knee.split()[1]:>6} {r['ttft_mean']:>8.3f} "
              f"{r['jct_mean']:>8.3f}")


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default=",".join(KINDS))
    ap.add_argument("--shapes", default="1:1:2,2:2:4,1:1:1",
                    help="prefill:decode:coupled GPUs per comparison (1:1:1 is 2 GPUs against 1)")
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--seeds", type=int, default=3, help="runs per class (medians)")
    ap.add_argument("--load", type=float, default=0.7, help="arrival rate as a share of the coupled side's capacity")
    ap.add_argument("--knee", type=int, default=PAPER_KNEE, help="prefill knee in positions (0: none)")
    ap.add_argument("--quick", action="store_true", help="smoke: every class, 1P+1D v 2C, 24 requests, 1 seed, "
                                                          "FCFS, no sensitivity sweep")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.requests, args.seeds = "1:1:2", 24, 1
    try:
        args.shape_list = parse_shapes(args.shapes)
    except (TypeError, ValueError) as e:
        ap.error(f"--shapes: {e}")
    if not set(args.classes.split(",")) <= set(KINDS) or args.requests < 4 or args.seeds < 1 \
            or not 0 < args.load <= 2 or args.knee < 0:
        ap.error(f"classes from {', '.join(KINDS)}; --requests >= 4; --seeds >= 1; --load in (0, 2]; --knee >= 0")
    return args


def main() -> int:
    args = arguments()
    policies = [PrefillPolicy.FCFS] if args.quick else [PrefillPolicy.FCFS, PrefillPolicy.SJF]
    costs = opt13b_v100(args.knee)
    print_costs(costs)
    absolute: dict[str, dict[str, dict[str, float]]] = {}
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for kind in args.classes.split(","):
        for shape in args.shape_list:
            key = f"{kind}|{shape.name}{'' if shape.equal else ' unequal'}"
            absolute[key] = run_class(kind, shape, policies, costs, args.requests, args.seeds, args.load)
            rows[key] = {n: ratios(f, absolute[key]["coupled"]) for n, f in absolute[key].items() if n != "coupled"}
            print(f"{key} done", file=sys.stderr, flush=True)
    table = {} if args.quick else sweep(costs, args.requests, (0.3, 0.5, 0.7, 0.9))
    print_ratios(rows)
    print_absolute(absolute)
    if table:
        print_sweep(table)
    print(json.dumps({
        "simulated_disagg_over_coupled": rows,
        "label": "SIMULATED (a cost model of OPT-13B on a V100 from published figures; nothing measured here)",
        "paper_direction_published": PAPER,
        "simulated_sensitivity": table,
        "simulated_seconds": {k: {n: {m: round(v, 4) for m, v in f.items()} for n, f in s.items()}
                              for k, s in absolute.items()},
        "costs": {k: v for k, v in asdict(costs).items() if k != "source"},
        "setup": {"requests": args.requests, "seeds": args.seeds, "load": args.load, "knee": args.knee,
                  "roofline_knee": roofline_knee(), "predictor": f"NoisyOracle g={G} accuracy={ACCURACY}",
                  "thresholds": asdict(THRESHOLDS), "shapes": args.shapes, "quick": args.quick},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
