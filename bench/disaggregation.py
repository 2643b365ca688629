"""Disaggregated against coupled serving on equal hardware, real and simulated (issue 13, point 10).

Real runs, in this process, each instance one single-stage pipeline of the default model (gguf
weights, exact precision) on ONE OpenVINO thread, so two instances share this machine's two cores:
- coupled: 2 coupled engines, each request to the one with the fewest streams and waiting requests
  (as the simulator's coupled cluster), chunked prefill interleaved with decode groups;
- disaggregated: 1 prefill + 1 decode instance behind the front end (disagg/front.py), oracle length
  prediction (the requests' own decode lengths, buckets of 64), FCFS, vanilla admission.
Both chunk prompts by 128 tokens (the knee of BENCHMARKS.md, issue 9). The same requests,
replayed at their Poisson arrival times (shardline_tools/sim/workloads.py: LPLD, LPHD, HPLD, HPHD, Mixed), each
generating exactly its decode length (greedy, no stop token). Each instance is busy while its
pipeline has graph work (sampled every 5 ms).

Simulated: the same requests through shardline_tools/sim/simulator*.py with costs fitted by bench/calibrate.py
on the same instance shape (`--costs`; calibrate with --stages 1 --threads 1). The simulator is
validated against the real runs: |simulated - measured| / measured of the p50 and p90 TTFT and JCT,
medians over repeats. Measured and simulated figures are kept apart in every table.

Arrival rate per class: `--load` (default 0.6) times what two instances serve, from the fitted costs:
2 / (prefill of the mean prompt + the mean decode at a 4-row group's cost per row).

    python bench/disaggregation.py --quick          # smoke: 2 classes, 6 requests, 1 repeat
    python bench/quiet.py && python bench/disaggregation.py --costs /tmp/shardline-bench/costs-1stage-1thread.json

The last line on stdout is one JSON object: per class the measured disaggregated/coupled ratios of
TTFT p50, JCT p50 and goodput first, then the simulator's errors, then every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kit import shard_folder, text_ids, wait_quiet  # bench/ is on sys.path when this script runs
from shardline_tools.sim.costs import Costs
from shardline_tools.sim.metrics import RequestRecord, Slo, Summary, summarize
from shardline_tools.sim.simulator import CoupledConfig, simulate_coupled
from shardline_tools.sim.simulator_disagg import DisaggConfig, from_length, simulate_disaggregated
from shardline_tools.sim.workloads import KINDS, THRESHOLDS, RequestSpec, Workload, generate

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig, SamplingConfig
from shardline.disagg.decode import decode_instance
from shardline.disagg.front import Disaggregated, FrontConfig
from shardline.disagg.instance import Admission
from shardline.disagg.predictor import Oracle
from shardline.disagg.prefill import oracle_predict, prefill_instance
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request, Serving
from shardline.serving.scheduler import SchedulerConfig

G, BUCKETS = 64, 8  # the predictor's bucket width (length_train.py) and buckets
STREAMS = 30  # stream slots per instance (the simulator's MAX_STREAMS)
SLO = Slo(ttft_s=2.0, tpot_s=0.1)  # goodput's latency target (TetriInfer-like: TTFT and per-token)
RUN_LIMIT_S = 900.0  # a run that has not finished by then fails the benchmark


@dataclass
class Timing:
    arrival: float
    first: float | None = None
    finish: float | None = None
    tokens: int = 0
    error: str = ""


class Balanced:
    """Coupled serving: each request to the engine with the fewest streams and waiting requests."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> object:
        best = min(range(len(self.engines)), key=lambda i: (self.engines[i].active + self.engines[i].waiting, i))
        return self.engines[best].submit(request, on_event)

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


def coupled(pipes: list[LocalPipeline]) -> Balanced:
    return Balanced([Engine(p, Limits(STREAMS, 256), 8192, SchedulerConfig(chunk=DEFAULT_PREFILL_CHUNK, groups=1))
                     for p in pipes])


def disaggregated(pipes: list[LocalPipeline]) -> Disaggregated:
    front = Disaggregated(FrontConfig(heavy_from=THRESHOLDS.heavy_decode[0]))
    prefill = prefill_instance(pipes[0], Limits(STREAMS, 256), 8192, DEFAULT_PREFILL_CHUNK, front.dispatch,
                               oracle_predict(G, BUCKETS))
    decode = decode_instance(pipes[1], Limits(STREAMS, 256), 8192,
                             SchedulerConfig(chunk=DEFAULT_PREFILL_CHUNK, groups=1),
                             Admission.VANILLA, STREAMS * 8192, THRESHOLDS.heavy_decode[0])
    front.start({"prefill": prefill}, {"decode": decode})
    return front


def busy_sampler(pipes: list[LocalPipeline], stop: threading.Event) -> dict[str, list[tuple[float, float]]]:
    """Each pipe's busy intervals (graph work running or queued), sampled every 5 ms until `stop`."""
    busy: dict[str, list[tuple[float, float]]] = {f"i{k}": [] for k in range(len(pipes))}
    since: list[float | None] = [None] * len(pipes)

    def sample() -> None:
        while not stop.wait(0.005):
            now = time.perf_counter()
            for k, p in enumerate(pipes):
                if not p.idle() and since[k] is None:
                    since[k] = now
                elif p.idle() and (t := since[k]) is not None:
                    busy[f"i{k}"].append((t, now))
                    since[k] = None
        now = time.perf_counter()
        for k, t in enumerate(since):
            if t is not None:
                busy[f"i{k}"].append((t, now))

    threading.Thread(target=sample, daemon=True).start()
    return busy


def drive(serving: Serving | Balanced, specs: Sequence[RequestSpec], prompts: list[list[int]],
          pipes: list[LocalPipeline]) -> Summary:
    """The requests at their arrival times; their records and the instances' busy time."""
    times = [Timing(0.0) for _ in specs]
    done = threading.Semaphore(0)

    def on(i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            now = time.perf_counter()
            t = times[i]
            if ev.token is not None:
                t.first = t.first or now
                t.tokens += 1
            if ev.finish:
                t.finish, t.error = now, ev.error or ("" if ev.finish == "length" else ev.finish)
                done.release()
        return event

    stop = threading.Event()
    busy = busy_sampler(pipes, stop)
    start = time.perf_counter()
    for i, s in enumerate(specs):
        time.sleep(max(0.0, start + s.arrival_s - time.perf_counter()))
        times[i].arrival = time.perf_counter()
        serving.submit(Request(prompts[i], SamplingConfig(max_tokens=s.decode_tokens, temperature=0.0),
                               frozenset()), on(i))
    for _ in specs:
        if not done.acquire(timeout=max(1.0, start + RUN_LIMIT_S - time.perf_counter())):
            raise SystemExit(f"a run took longer than {RUN_LIMIT_S:.0f} s")
    stop.set()
    time.sleep(0.02)
    if errors := [t.error for t in times if t.error]:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    records = [RequestRecord(t.arrival - start, (t.first or t.finish or 0) - start, (t.finish or 0) - start, t.tokens)
               for t in times]
    shifted = {k: [(a - start, b - start) for a, b in v] for k, v in busy.items()}
    return summarize(records, shifted, len(pipes), SLO)


def warm(pipes: list[LocalPipeline], folder: Path) -> None:
    """Every pipe through long and short prompts and a 4-row group before anything is timed (a
    fresh InferRequest's first shapes are slow)."""
    engines = [Engine(p, Limits(8, 8), 8192, SchedulerConfig(chunk=DEFAULT_PREFILL_CHUNK, groups=1)) for p in pipes]
    done = threading.Semaphore(0)
    lengths = [1100, 300, 60, 40, 20]
    try:
        for e in engines:
            for n in lengths:
                e.submit(Request(text_ids(folder, n), SamplingConfig(max_tokens=40), frozenset()),
                         lambda ev: done.release() if ev.finish else None)
        for _ in range(len(engines) * len(lengths)):
            if not done.acquire(timeout=300):
                raise SystemExit("the warm-up did not finish in 300 s")
    finally:
        for e in engines:
            e.stop()


def rate_for(specs: Sequence[RequestSpec], costs: Costs, load: float) -> float:
    """`load` times the requests per second two instances serve (module docstring)."""
    prompt = statistics.mean(s.prompt_tokens for s in specs)
    decode = statistics.mean(s.decode_tokens for s in specs)
    per_request = costs.prefill_s(prompt, 0) + decode * costs.decode_s(4, prompt + decode / 2) / 4
    return load * 2 / per_request


def workload(kind: str, n: int, seed: int, costs: Costs, load: float) -> list[RequestSpec]:
    shape = generate(Workload(kind, n, 1.0, seed))  # the lengths (independent of the rate)
    return generate(Workload(kind, n, rate_for(shape, costs, load), seed))


def simulated(specs: Sequence[RequestSpec], costs: Costs) -> dict[str, Summary]:
    c = simulate_coupled(specs, costs, CoupledConfig(instances=2, max_streams=STREAMS))
    d = simulate_disaggregated(specs, costs, ORACLE,
                               DisaggConfig(pad_chunks=False, admission=Admission.VANILLA, max_streams=STREAMS))
    return {"coupled": c.summary(SLO), "disagg": d.summary(SLO)}


FIGS = ("ttft_p50_s", "ttft_p90_s", "jct_p50_s", "jct_p90_s", "goodput_rps", "tokens_per_busy_instance_s")


def medians(runs: list[Summary]) -> dict[str, float]:
    return {f: statistics.median(r.as_dict()[f] for r in runs) for f in FIGS}


ORACLE = from_length(Oracle(G, BUCKETS))


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None  # nothing met the SLO under the baseline: no ratio


def fleet(kinds: list[str], sizes: list[int], per_instance: int, costs: Costs, load: float, slo: Slo = SLO) -> None:
    """Simulated only: N coupled instances against N/2 prefill + N/2 decode (the split is fixed
    before anything is tuned), the same requests (per_instance x N of them, the rate scaled by
    N / 2); then the best split of N/4, N/2 and 3N/4 prefill instances by Mixed-free goodput."""
    print(f"\nSIMULATED fleets ({per_instance} requests per instance, load {load}; SLO TTFT <= {slo.ttft_s} s, "
          f"TPOT <= {slo.tpot_s} s)")
    print(f"{'N':>3} {'class':<6} {'system':<14}" + "".join(f"{f:>14}" for f in FIGS))
    out: dict[str, dict[str, float | None]] = {}
    for n in sizes:
        for kind in kinds:
            shape = generate(Workload(kind, per_instance * n, 1.0, 0))
            specs = generate(Workload(kind, per_instance * n, rate_for(shape, costs, load) * n / 2, 0))
            rows = {"coupled": simulate_coupled(specs, costs, CoupledConfig(instances=n, max_streams=STREAMS))}
            for p in sorted({max(1, n // 4), n // 2, min(n - 1, 3 * n // 4)}):
                cfg = DisaggConfig(prefill=p, decode=n - p, pad_chunks=False, admission=Admission.VANILLA,
                                   max_streams=STREAMS)
                rows[f"disagg {p}:{n - p}"] = simulate_disaggregated(specs, costs, ORACLE, cfg)
            sums = {name: r.summary(slo).as_dict() for name, r in rows.items()}
            for name, m in sums.items():
                print(f"{n:>3} {kind:<6} {name:<14}" + "".join(f"{m[f]:>14.3f}" for f in FIGS))
            half = sums[f"disagg {n // 2}:{n - n // 2}"]
            c = sums["coupled"]
            best = max((k for k in sums if k != "coupled"), key=lambda k: (sums[k]["goodput_rps"], k))
            out[f"N{n}_{kind}"] = {
                "ttft_p50_half_over_coupled": round(half["ttft_p50_s"] / c["ttft_p50_s"], 3),
                "jct_p50_half_over_coupled": round(half["jct_p50_s"] / c["jct_p50_s"], 3),
                "goodput_half_over_coupled": ratio(half["goodput_rps"], c["goodput_rps"]),
                "best_split": float(best.split()[1].split(":")[0]),
                "goodput_best_over_coupled": ratio(sums[best]["goodput_rps"], c["goodput_rps"]),
            }
    print(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default=",".join(KINDS))
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per class and system (seeds 0..)")
    ap.add_argument("--load", type=float, default=0.6, help="arrival rate as a share of two instances' capacity")
    ap.add_argument("--costs", type=Path, default=Path("/tmp/shardline-bench/costs-1stage-1thread.json"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--max-wait", type=float, default=1200.0, help="seconds to wait for a quiet machine")
    ap.add_argument("--fleet", default="", help="simulate only, fleets of these sizes (e.g. 8,16,64)")
    ap.add_argument("--slo", default="", metavar="TTFT,TPOT", help="with --fleet: goodput's latency target in "
                                                                     f"seconds (default {SLO.ttft_s},{SLO.tpot_s})")
    ap.add_argument("--quick", action="store_true", help="smoke: LPLD and HPLD, 6 requests, 1 repeat, no wait")
    args = ap.parse_args()
    if args.quick:
        args.classes, args.requests, args.repeats, args.max_wait = "LPLD,HPLD", 6, 1, 0
    kinds = args.classes.split(",")
    if not set(kinds) <= set(KINDS) or args.requests < 4 or args.repeats < 1 or not 0 < args.load <= 2:
        ap.error(f"classes from {', '.join(KINDS)}; --requests >= 4; --repeats >= 1; --load in (0, 2]")
    costs = Costs.from_json(args.costs) if args.costs.is_file() else Costs()
    if args.fleet:
        sizes = [int(x) for x in args.fleet.split(",")]
        if min(sizes) < 2:
            ap.error("--fleet sizes must be >= 2")
        ttft, tpot = (float(x) for x in args.slo.split(",")) if args.slo else (SLO.ttft_s, SLO.tpot_s)
        fleet(kinds, sizes, args.requests, costs, args.load, Slo(ttft_s=ttft, tpot_s=tpot))
        return 0
    quiet, load = wait_quiet(max_wait_s=args.max_wait)
    folder = shard_folder(args.work, 1)
    pipes = [LocalPipeline(folder, RunConfig(precision="exact", threads=1, pinned=False)) for _ in range(2)]
    warm(pipes, folder)
    real: dict[tuple[str, str], list[Summary]] = {}
    sims: dict[tuple[str, str], list[Summary]] = {}
    try:
        for kind in kinds:
            for seed in range(args.repeats):
                specs = workload(kind, args.requests, seed, costs, args.load)
                prompts = [text_ids(folder, s.prompt_tokens) for s in specs]
                systems = [("coupled", coupled), ("disagg", disaggregated)]
                for system, build in systems[:: 1 if seed % 2 == 0 else -1]:  # each goes first in turn
                    serving = build(pipes)
                    try:
                        real.setdefault((kind, system), []).append(drive(serving, specs, prompts, pipes))
                    finally:
                        serving.stop()
                for system, summary in simulated(specs, costs).items():
                    sims.setdefault((kind, system), []).append(summary)
                print(f"{kind} seed {seed} done", file=sys.stderr, flush=True)
    finally:
        for p in pipes:
            p.shutdown()
    report(kinds, real, sims, costs, args, quiet, load)
    return 0


def report(kinds: list[str], real: dict[tuple[str, str], list[Summary]], sims: dict[tuple[str, str], list[Summary]],
           costs: Costs, args: argparse.Namespace, quiet: bool, load: float) -> None:
    print(f"\n{args.requests} requests per run, {args.repeats} runs per class (medians), load {args.load}; "
          f"SLO TTFT <= {SLO.ttft_s} s and TPOT <= {SLO.tpot_s} s; {'quiet' if quiet else 'NOT quiet'} "
          f"(load {load:.2f}); costs: {costs.source[:80]}")
    head = f"{'class':<6} {'system':<8} {'kind':<9}" + "".join(f"{f:>14}" for f in FIGS)
    print(head)
    out: dict[str, dict[str, float | None]] = {}
    for kind in kinds:
        row: dict[str, float] = {}
        for where, table in (("measured", real), ("simulated", sims)):
            for system in ("coupled", "disagg"):
                m = medians(table[kind, system])
                print(f"{kind:<6} {system:<8} {where:<9}" + "".join(f"{m[f]:>14.3f}" for f in FIGS))
                row |= {f"{where}_{system}_{f}": round(m[f], 4) for f in FIGS}
        out[kind] = {**ratios(row), **row}
    print(json.dumps(out))


def ratios(row: dict[str, float]) -> dict[str, float | None]:
    """Measured disagg/coupled ratios first, then the simulator's relative errors."""
    out: dict[str, float | None] = {
        f"disagg_over_coupled_{f}": ratio(row[f"measured_disagg_{f}"], row[f"measured_coupled_{f}"])
        for f in ("ttft_p50_s", "jct_p50_s", "goodput_rps")}
    for system in ("coupled", "disagg"):
        for f in ("ttft_p50_s", "ttft_p90_s", "jct_p50_s", "jct_p90_s"):
            m, s = row[f"measured_{system}_{f}"], row[f"simulated_{system}_{f}"]
            out[f"sim_error_{system}_{f}"] = round(abs(s - m) / m, 3) if m else None
    return out


if __name__ == "__main__":
    sys.exit(main())
