"""Distributed decode: in-process stages vs the same exports through worker processes on loopback.

Stage 0 always runs in the coordinator; a K-stage export uses K-1 workers (1, 2 and 3 here).
Compared, in one run and interleaved across systems: decode tok/s (in-process, worker chain, star,
f16 vs f32 activations), per-hop transport overhead (worker step minus in-process step, paired by
decode step, divided by the hops a token makes), the per-token breakdown every token carries
(graph per stage, encode, decode, worker and coordinator host, wire: see pipeline/timing.py),
bytes per token on the wire (top-1 and, measured, full logits), the transport alone per hop
(bench/hop.py: real codec and link between two processes, no graph), and a latency sweep through
`shardline relay` on every hop. Greedy, exact precision, N new tokens, stop tokens ignored;
medians over reps.

    python bench/pipeline.py --quick      # 16 tokens, 1 rep, delays 0 and 20 ms
    python bench/pipeline.py              # 64 tokens, 3 reps, delays 0 5 20 50 100 ms

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import hop
import numpy as np
from kit import Proc, relays, shard_folder  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig, SamplingParams
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome, Step, decode, prefill
from shardline.pipeline.plan import run as run_step
from shardline.pipeline.remote import RemotePipeline
from shardline.pipeline.timing import Timing
from shardline.stage.cache import KVBook

GREEDY = SamplingParams()
KEYS = count(1)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
Pipe = LocalPipeline | RemotePipeline


# --- subprocesses ------------------------------------------------------------------------------


@contextmanager
def started(procs: list[Proc]) -> Iterator[list[Proc]]:
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


# --- runs --------------------------------------------------------------------------------------


@dataclass
class Sample:
    decode_s: float
    tokens: list[int]
    step_s: list[float]  # each decode step, timed around it
    sent: list[int] = field(default_factory=list)  # coordinator bytes out per decode step (all links)
    received: list[int] = field(default_factory=list)  # coordinator bytes in per decode step
    timings: list[Timing] = field(default_factory=list)  # per decode step (workers only)


def step_once(pipe: Pipe, step: Step) -> tuple[Outcome, Timing | None]:
    """One planned step through the pipeline, waited for; its timing through workers only (in
    process it has graph time alone)."""
    (out,) = run_step(pipe, step, timeout=120)
    if out.failed:
        raise RuntimeError(out.error)
    return out, out.timing if isinstance(pipe, RemotePipeline) else None


def generate(pipe: Pipe, prompt: list[int], n: int, want_logits: bool = False) -> Sample:
    """Exactly n greedy tokens: one prefill step, n-1 decode steps, each timed."""
    s = Sample(0.0, [], [])
    key, book = next(KEYS), KVBook()
    links = pipe.links if isinstance(pipe, RemotePipeline) else []
    try:
        out, _ = step_once(pipe, prefill(key, book, prompt, GREEDY, first=True, last=True))
        s.tokens.append(out.choices[0].token)
        for _ in range(n - 1):
            out0, in0 = sum(k.bytes_sent for k in links), sum(k.bytes_received for k in links)
            t = time.perf_counter()
            out, timing = step_once(pipe, decode(key, book, [s.tokens[-1]], GREEDY, want_logits=want_logits))
            s.step_s.append(time.perf_counter() - t)
            s.tokens.append(out.choices[0].token)
            if timing is not None:
                s.timings.append(timing)
            s.sent.append(sum(k.bytes_sent for k in links) - out0)
            s.received.append(sum(k.bytes_received for k in links) - in0)
    finally:
        pipe.release(key)
    s.decode_s = sum(s.step_s)
    return s


def tok_s(runs: list[Sample]) -> float:
    return statistics.median(len(r.step_s) / r.decode_s for r in runs)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def hops(name: str) -> int:
    workers = int(name.split("-")[1])
    return 2 * workers if "star" in name else workers + 1


def reference(name: str) -> str:
    """The in-process system with the same export: W workers run a (W+1)-stage export."""
    return name if name.startswith("inproc-") else f"inproc-{int(name.split('-')[1]) + 1}stage"


def breakdown(runs: list[Sample]) -> dict[str, float]:
    """Mean ms per decode token of every part (means, so the parts add up to the total), plus the
    medians of the total and of the wire (the mean carries the scheduler's occasional long waits)."""
    ts = [t for r in runs for t in r.timings]
    parts = {k: 1e3 * statistics.fmean(t.parts()[k] for t in ts) for k in ts[0].parts()}
    return parts | {"total": 1e3 * statistics.fmean(t.total_s for t in ts),
                    "total p50": 1e3 * statistics.median(t.total_s for t in ts),
                    "wire p50": 1e3 * statistics.median(t.wire_s for t in ts)}


def print_breakdown(table: dict[str, dict[str, float]]) -> None:
    print("\nper-token breakdown, ms per decode token (mean over every decode step of every rep; the parts "
          "add up to the total; graph = inside each stage's infer call, wire = round trip minus all measured)")
    graphs = sorted({c for row in table.values() for c in row if c.startswith("graph")})
    columns = graphs + ["encode", "decode", "worker host", "coordinator host", "wire", "total", "total p50",
                        "wire p50"]
    names = {c: c.replace("graph stage ", "graph ").replace("coordinator", "coord") for c in columns}
    print(f"{'system':<22}" + "".join(f"{names[c]:>11}" for c in columns))
    for name, row in table.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>11.2f}" if c in row else f"{'':>11}" for c in columns))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--delays", default="0,5,20,50,100", help="relay one-way delay per hop, ms (comma-separated)")
    p.add_argument("--sweep-tokens", type=int, default=16, help="tokens per run for delays >= 20 ms")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench" / "pipeline")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 1 rep, delays 0 and 20 ms")
    p.add_argument("--trips", type=int, default=3000, help="round trips per case of the transport-alone part")
    p.add_argument("--max-minutes", type=float, default=20.0, help="skip remaining reps/delays after this")
    args = p.parse_args()
    n, reps = (16, 1) if args.quick else (args.tokens, args.reps)
    delays = [0.0, 20.0] if args.quick else [float(d) for d in args.delays.split(",")]
    if n < 3:
        p.error("--tokens must be at least 3")
    deadline = time.monotonic() + args.max_minutes * 60
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    f2, f3, f4 = shard_folder(args.work, 2), shard_folder(args.work, 3), shard_folder(args.work, 4)
    transport = hop.measure(args.trips)  # first, while no worker holds a core
    vocab = load_manifest(f3).arch.vocab
    prompt = ChatTokenizer(f3).encode_chat([{"role": "user", "content": PROMPT}])
    run = RunConfig()  # precision "exact"

    def worker(folder: Path, stage: str) -> Proc:
        return Proc(["worker", "--shards", str(folder), "--stage", stage, "--listen", "127.0.0.1:0", "--insecure"],
                    "listening on ")

    procs: list[Proc] = []
    with started(procs):
        procs += [worker(f2, "1"), worker(f3, "1"), worker(f3, "2"), worker(f4, "1"), worker(f4, "2"), worker(f4, "3")]
        addrs = [q.addr for q in procs]
        w2, w3, w4 = addrs[:1], addrs[1:3], addrs[3:]
        pipes: dict[str, Pipe] = {
            "inproc-2stage": LocalPipeline(f2, run),
            "workers-1-chain-f16": RemotePipeline(f2, w2, run, "f16", "chain"),
            "inproc-3stage": LocalPipeline(f3, run),
            "workers-2-chain-f16": RemotePipeline(f3, w3, run, "f16", "chain"),
            "workers-2-star-f16": RemotePipeline(f3, w3, run, "f16", "star"),
            "workers-2-chain-f32": RemotePipeline(f3, w3, run, "f32", "chain"),
            "inproc-4stage": LocalPipeline(f4, run),
            "workers-3-chain-f16": RemotePipeline(f4, w4, run, "f16", "chain"),
        }
        for pipe in pipes.values():
            generate(pipe, prompt, 4)  # warm-up
        samples: dict[str, list[Sample]] = {k: [] for k in pipes}
        for r in range(reps):
            if r and time.monotonic() > deadline:
                print(f"time box: stopping after {r} reps", file=sys.stderr)
                break
            for name, pipe in pipes.items():
                samples[name].append(s := generate(pipe, prompt, n))
                print(f"rep {r + 1}/{reps} {name}: {len(s.step_s) / s.decode_s:.1f} tok/s", file=sys.stderr)
        # Full logits, measured: the same chain with a stream that asks for them.
        logits_run = generate(pipes["workers-2-chain-f16"], prompt, min(n, 16), want_logits=True)
        for pipe in pipes.values():
            pipe.shutdown()

        sweep: dict[str, dict[str, float]] = {}
        sweep_wire: dict[str, dict[str, float]] = {}  # median wire ms per token
        sweep_samples: dict[str, list[list[int]]] = {}
        for delay in delays:
            if time.monotonic() > deadline:
                print(f"time box: sweep stopped before {delay:g} ms", file=sys.stderr)
                break
            m = n if delay < 20 else min(n, args.sweep_tokens)
            # coordinator -> r0 -> w1; w1 -> r1 -> w2 (Route); w2 -> r1 -> coordinator
            with relays(w3, delay) as via:
                sweep[f"{delay:g}ms"], sweep_wire[f"{delay:g}ms"] = {}, {}
                for topo in ("chain", "star"):
                    remote = RemotePipeline(f3, via, run, "f16", topo)
                    try:
                        runs = [generate(remote, prompt, m) for _ in range(reps)]
                    finally:
                        remote.shutdown()
                    sweep[f"{delay:g}ms"][topo] = round(tok_s(runs), 2)
                    sweep_wire[f"{delay:g}ms"][topo] = round(breakdown(runs)["wire p50"], 2)
                    sweep_samples[f"{delay:g}ms-{topo}"] = [x.tokens for x in runs]
                    print(f"delay {delay:g} ms {topo}: {tok_s(runs):.2f} tok/s ({m} tokens)", file=sys.stderr)

    # --- report --------------------------------------------------------------------------------
    tps = {k: tok_s(v) for k, v in samples.items() if v}
    ref = {k: reference(k) for k in tps}
    print(f"\n{n} new tokens, prompt {len(prompt)} tokens, gguf weights, exact precision, median of "
          f"{len(samples['inproc-2stage'])}, load average {load:.1f} at start")
    print(f"{'system':<22}{'decode tok/s':>14}{'ms/token':>10}{'vs in-process':>15}{'same tokens':>13}")
    for k, v in tps.items():
        same = "yes" if samples[k][0].tokens == samples[ref[k]][0].tokens else "NO"
        print(f"{k:<22}{v:>14.1f}{1e3 / v:>10.2f}{ratio(v, tps[ref[k]]) or 0:>15.3f}{same:>13}")

    overhead: dict[str, dict[str, float]] = {}
    print("\nper-hop transport overhead, us: (worker step - in-process step) / hops, paired by step index")
    for k in tps:
        if not k.startswith("workers-"):
            continue
        diffs = [(a - b) * 1e6 / hops(k) for ra, rb in zip(samples[k], samples[ref[k]], strict=False)
                 for a, b in zip(ra.step_s, rb.step_s, strict=True)]
        overhead[k] = {"hops": hops(k), "median_us": round(float(np.median(diffs)), 1),
                       "p99_us": round(float(np.percentile(diffs, 99)), 1)}
        print(f"{k:<22}{hops(k)} hops  median {overhead[k]['median_us']:>8.1f}  p99 {overhead[k]['p99_us']:>8.1f}")

    hop.print_table(transport)
    in_pipeline: dict[str, dict[str, float]] = {}
    print("\nper-hop transport inside the pipeline, us: (encode + decode + wire) / hops, from each token's "
          "breakdown (3 processes share 2 cores here: a woken process often waits for one)")
    for k, v in samples.items():
        if v and v[0].timings:
            per_hop = [1e6 * (t.encode_s + t.decode_s + t.wire_s) / hops(k) for r in v for t in r.timings]
            in_pipeline[k] = {"median_us": round(statistics.median(per_hop), 1),
                              "p99_us": round(float(np.percentile(per_hop, 99)), 1)}
            print(f"{k:<22}{hops(k)} hops  median {in_pipeline[k]['median_us']:>8.1f}  "
                  f"p99 {in_pipeline[k]['p99_us']:>8.1f}")

    table = {k: breakdown(v) for k, v in samples.items() if v and v[0].timings}
    print_breakdown(table)

    # Full logits, measured on workers-2-chain-f16: what the last worker's Sampled frame weighs.
    top1 = statistics.median(x for r in samples["workers-2-chain-f16"] for x in r.received)
    full = statistics.median(logits_run.received)
    wire: dict[str, dict[str, float]] = {}
    print("\nbytes per decode token on the wire (coordinator's links measured; chain worker->worker "
          "hops inferred as one more Forward frame each)")
    print(f"{'system':<22}{'Forward':>9}{'coord out':>11}{'coord in':>10}{'all hops top-1':>16}"
          f"{'all hops logits*':>18}")
    for k in tps:
        if not k.startswith("workers-"):
            continue
        sent = statistics.median(x for r in samples[k] for x in r.sent)
        back = statistics.median(x for r in samples[k] for x in r.received)
        n_w = int(k.split("-")[1])
        star = "star" in k
        fwd = sent / n_w if star else sent  # star: one Forward to every worker; chain: one to the first
        total = sent + back + (0 if star else fwd * (n_w - 1))
        logits_total = total - top1 + full
        wire[k] = {"forward_frame": fwd, "coordinator_sent": sent, "coordinator_received": back,
                   "all_hops_top1": total, "all_hops_full_logits": logits_total}
        print(f"{k:<22}{fwd:>9.0f}{sent:>11.0f}{back:>10.0f}{total:>16.0f}{logits_total:>18.0f}")
    print(f"* the last worker's Sampled frame measured with full logits (vocab {vocab}, f32): {full:.0f} B "
          f"instead of {top1:.0f} B (a step with want_logits; the other frames as measured top-1)")

    if sweep:
        print("\nlatency sweep, 2 workers, f16, relay on every hop (chain 3 delays per token, star 4): tok/s, "
              "and the wire's share of a token (median ms)")
        print(f"{'delay/hop':<12}{'chain':>10}{'star':>10}{'chain/star':>12}{'chain wire':>12}{'star wire':>11}")
        for d, v in sweep.items():
            w = sweep_wire[d]
            print(f"{d:<12}{v['chain']:>10.2f}{v['star']:>10.2f}{ratio(v['chain'], v['star']) or 0:>12.3f}"
                  f"{w['chain']:>12.2f}{w['star']:>11.2f}")
    sweep_same = all(t == samples["inproc-3stage"][0].tokens[: len(t)] for ts in sweep_samples.values() for t in ts)

    figures = {
        "ratio_worker_chain_2stage_vs_inproc_2stage": ratio(tps.get("workers-1-chain-f16"), tps.get("inproc-2stage")),
        "ratio_worker_chain_3stage_vs_inproc_3stage": ratio(tps.get("workers-2-chain-f16"), tps.get("inproc-3stage")),
        "ratio_chain_vs_star_3stage": ratio(tps.get("workers-2-chain-f16"), tps.get("workers-2-star-f16")),
        "ratio_f16_vs_f32_chain_3stage": ratio(tps.get("workers-2-chain-f16"), tps.get("workers-2-chain-f32")),
        "ratio_worker_chain_4stage_vs_inproc_4stage": ratio(tps.get("workers-3-chain-f16"), tps.get("inproc-4stage")),
        "target_2stage_ratio": 0.9,
        "transport_hop_us_median_own_core": transport["own core each"]["median_us"], "target_hop_us": 100,
        "transport_alone": transport, "transport_in_pipeline": in_pipeline,
        "tokens": n, "reps": len(samples["inproc-2stage"]), "prompt_tokens": len(prompt), "precision": "exact",
        "weights": "gguf", "load_avg_1m_at_start": round(load, 2),
        "decode_tok_s": {k: round(v, 2) for k, v in tps.items()},
        "hop_overhead_us": overhead, "bytes_per_token": wire,
        "sampled_frame_bytes_measured": {"top1": top1, "full_logits": full},
        "breakdown_ms": {k: {c: round(x, 3) for c, x in row.items()} for k, row in table.items()},
        "latency_sweep_tok_s": sweep, "latency_sweep_wire_ms": sweep_wire, "sweep_tokens_match_inproc": sweep_same,
    }
    print("\nratios (decode tok/s): " + ", ".join(f"{k[6:]} {v}" for k, v in figures.items()
                                                  if k.startswith("ratio_")))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
