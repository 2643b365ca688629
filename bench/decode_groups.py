"""The serving engine with decode groups (batched calls) against interleaving, in one run.

The engine drives the default 2-stage export in this process (what `shardline serve` runs by
default). For 1, 2, 4 and 8 concurrent streams it measures aggregate decode tok/s with:
- groups 0: every stream its own call per stage per step (interleaved, each stage kept busy);
- groups 1: all streams in one group, one call per stage per step (stages take turns);
- groups 2: two groups, one per stage (while stage 1 runs one group, stage 0 runs the other).
Greedy, exact precision, N tokens per stream (stop tokens ignored); systems interleaved per
rep, medians. Every run's tokens are checked against the same prompt alone.

Then the same through HTTP: `shardline serve --decode-groups 1` and `--decode-groups 0` on the
same export, each under the open-loop Poisson load of bench/serving.py (TTFT, time per output
token, end-to-end latency, throughput).

    python bench/decode_groups.py --quick
    python bench/decode_groups.py            # 64 tokens, 3 reps

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from http_load import load  # bench/ is on sys.path when this script runs
from kit import Proc, open_serving, shard_folder

from shardline.config import SamplingConfig, ServeConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.serving.engine import Engine, Event, Request

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a bicycle stays upright.", "List five uses of a paperclip.",
           "What is the capital of France?"]


def run(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Aggregate decode tok/s over all streams (tokens after each stream's first, from the first
    stream's first token to the last stream's last token), and each stream's tokens."""
    done = threading.Semaphore(0)
    stamps: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]

    def collector(i: int) -> Callable[[Event], None]:
        def on(ev: Event) -> None:
            if ev.token is not None:
                stamps[i].append(time.perf_counter())
                tokens[i].append(ev.token)
            if ev.finish:
                done.release()
        return on

    for i, p in enumerate(prompts):
        engine.submit(Request(p, SamplingConfig(max_tokens=n), frozenset()), collector(i))
    for _ in prompts:
        if not done.acquire(timeout=600):
            raise RuntimeError("a stream did not finish within 600 s")
    first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    return sum(len(s) - 1 for s in stamps) / (last - first), tokens


def http(folder: Path, rates: list[float], count: int, n: int) -> dict[str, list[dict[str, float]]]:
    """Open-loop load against `shardline serve` with decode groups 1 and 0, one server at a time."""
    out: dict[str, list[dict[str, float]]] = {}
    for groups in (1, 0):
        server = Proc(["serve", "--shards", str(folder), "--port", "0", "--model-id", "m", "--max-streams", "8",
                       "--decode-groups", str(groups)], "serving ", stream="stderr")
        url = server.url + "/completions"
        try:
            out[f"groups{groups}"] = [asyncio.run(load(url, "m", r, count, n, seed=int(r * 1000))) for r in rates]
        finally:
            server.stop()
        for row in out[f"groups{groups}"]:
            print(f"groups {groups} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()), file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="24 tokens, 1 rep")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rates", default="2,4", help="request rates for the HTTP part, req/s (empty: skip it)")
    p.add_argument("--requests", type=int, default=24, help="requests per rate in the HTTP part")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    args = p.parse_args()
    n, reps = (24, 1) if args.quick else (args.tokens, args.reps)
    load = os.getloadavg()[0]
    folder = shard_folder(args.work, 2, balance=True)
    tok = ChatTokenizer(folder)
    chats = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]
    systems = {g: open_serving(folder, serve=ServeConfig(max_streams=8, max_queue=8, decode_groups=g))[0]
               for g in (0, 1, 2)}
    for engine in systems.values():  # warm-up: first calls of each shape, a first join
        run(engine, chats[:2], 4)
    alone = {i: run(systems[0], [c], n)[1][0] for i, c in enumerate(chats)}
    counts = (1, 2, 4, 8)
    tps: dict[str, list[float]] = {f"g{g}-s{s}": [] for g in systems for s in counts}
    same: dict[str, bool] = {}
    for r in range(reps):
        for s in counts:
            prompts = [chats[i % len(chats)] for i in range(s)]
            for g, engine in systems.items():
                rate, got = run(engine, prompts, n)
                tps[f"g{g}-s{s}"].append(rate)
                same[f"g{g}-s{s}"] = same.get(f"g{g}-s{s}", True) and all(
                    t == alone[i % len(chats)] for i, t in enumerate(got))
                print(f"rep {r + 1}/{reps} groups {g}, {s} streams: {rate:.1f} tok/s", file=sys.stderr)
    for engine in systems.values():
        engine.shutdown()
    rates = [float(r) for r in args.rates.split(",") if r] if not args.quick else [2.0]
    served = http(folder, rates, 8 if args.quick else args.requests, n) if rates else {}
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(f"\n{n} tokens per stream, default 2-stage export in one process, exact precision, median of "
          f"{reps}, load average {load:.1f} at start")
    print(f"{'streams':>8}" + "".join(f"{'groups ' + str(g):>12}" for g in systems)
          + f"{'g2 / g0':>10}{'g1 / g0':>10}{'same tokens':>13}")
    for s in counts:
        row = [med[f"g{g}-s{s}"] for g in systems]
        ok = all(same[f"g{g}-s{s}"] for g in systems)
        print(f"{s:>8}" + "".join(f"{v:>12.1f}" for v in row) + f"{row[2] / row[0]:>10.2f}{row[1] / row[0]:>10.2f}"
              + f"{'yes' if ok else 'NO':>13}")
    if served:
        print(f"\nHTTP, Poisson arrivals, {n} tokens per request, `shardline serve --decode-groups G`")
        print(f"{'G':>3} {'req/s':>6} {'tok/s':>7} {'ttft_p50':>9} {'ttft_p90':>9} {'tpot_p50':>9} {'tpot_p90':>9} "
              f"{'e2e_p50':>9} {'e2e_p90':>9}")
        for name, rows in served.items():
            for r in rows:
                print(f"{name[6:]:>3} {r['rate']:6.1f} {r['throughput_tok_s']:7.1f} {r['ttft_p50_ms']:9.1f} "
                      f"{r['ttft_p90_ms']:9.1f} {r['tpot_p50_ms']:9.1f} {r['tpot_p90_ms']:9.1f} "
                      f"{r['e2e_p50_ms']:9.1f} {r['e2e_p90_ms']:9.1f}")
    figures: dict[str, object] = {f"groups2_vs_interleaved_s{s}": round(med[f"g2-s{s}"] / med[f"g0-s{s}"], 3)
                                  for s in counts}
    figures |= {f"groups1_vs_interleaved_s{s}": round(med[f"g1-s{s}"] / med[f"g0-s{s}"], 3) for s in counts}
    figures |= {"tokens": n, "reps": reps, "load_avg_1m_at_start": round(load, 2),
                "decode_tok_s": {k: round(v, 2) for k, v in med.items()}, "same_tokens_as_alone": same,
                "http": served}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
