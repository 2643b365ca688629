"""Serving many users: aggregate decode speed against concurrency, and an open-loop HTTP load.

Part 1 drives the engine directly on a 2-stage pipeline in two processes (stage 0 in this
process, stage 1 in a `shardline worker`): 1, 2, 4 and 8 concurrent streams, each generating N
tokens (stop tokens ignored), three ways side by side: decode groups 0 (one call per stream per
step, interleaved), 1 (every stream in one batched call per stage) and 2 (two batches taking
turns on the two stages). With `--pin` (default) each process gets one core of its own and
one OpenVINO thread, as two 1-core PCs would (this process, the coordinator and later the HTTP
client, on core 0; the worker on core 1); `--no-pin` lets both use both cores.

Part 2 starts `shardline serve` (with the same worker) and sends requests with Poisson arrivals
at several rates from an asyncio client (bounded count and time): TTFT, time per output token,
end-to-end latency at p50/p90/p99, throughput, and the client's own lag behind its schedule.

    python bench/serving.py --quick        # fewer tokens and requests
    python bench/serving.py
    python bench/serving.py --runners      # part 2 only: the paged export against the stateful one

With `--runners` (issue 41) part 2 runs `shardline serve` on the stateful export and on the paged
one, each with every stage in its process (both cores) and with stage 1 on a worker (pinned as
above), at the same seeded arrivals: the paged/stateful ratios of throughput and of the p50 TTFT,
TPOT and end-to-end latency come first in the JSON line.

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

from http_load import PROMPT, load  # bench/ is on sys.path when this script runs
from kit import Proc, shard_folder

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig

# --- part 1: aggregate decode tok/s against concurrency -----------------------------------------


def concurrency_run(engine: Engine, prompt: list[int], streams: int, n: int) -> float:
    """Aggregate decode tok/s: tokens after each stream's first, over the time from the first
    stream's first token to the last stream's last token."""
    finished = threading.Semaphore(0)  # released once per stream, on the engine thread
    stamps: list[list[float]] = [[] for _ in range(streams)]

    def collector(i: int) -> Callable[[Event], None]:
        def on(ev: Event) -> None:
            if ev.token is not None:
                stamps[i].append(time.perf_counter())
            if ev.finish:
                finished.release()
        return on

    for i in range(streams):
        engine.submit(Request(prompt, SamplingConfig(max_tokens=n), frozenset()), collector(i))
    for _ in range(streams):
        if not finished.acquire(timeout=600):
            raise RuntimeError("a stream did not finish within 600 s")
    first = min(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    decoded = sum(len(s) - 1 for s in stamps)
    return decoded / (last - first)


def part1(folder: Path, prompt: list[int], n: int, reps: int, pin: bool,
          groups: tuple[int, ...] = (0, 1, 2)) -> dict[str, float]:
    """Aggregate tok/s per (decode groups, streams): 0 groups interleave one stream per call;
    1 batches every stream into one call per stage; 2 alternate two batches over the stages."""
    threads = 1 if pin else 2
    worker_cmd = ["worker", "--shards", str(folder), "--stage", "1", "--listen", "127.0.0.1:0",
                  "--threads", str(threads), "--insecure"]
    worker = Proc(worker_cmd, "listening on ", cpus="1" if pin else None)
    try:
        addr = [worker.addr]
        # One coordinator per setting, all on the same worker: each is a session of its own there.
        pipes = {g: RemotePipeline(folder, addr, RunConfig(threads=threads)) for g in groups}
        engines = {g: Engine(p, Limits(max_streams=8, max_queue=8), 8192, SchedulerConfig(groups=g))
                   for g, p in pipes.items()}
        runs: dict[str, list[float]] = {}
        for engine in engines.values():
            concurrency_run(engine, prompt, 2, 8)  # warm-up (and a first merge)
        for r in range(reps):
            for streams in (1, 2, 4, 8):
                for g, engine in engines.items():
                    runs.setdefault(f"groups{g}-streams{streams}", []).append(
                        concurrency_run(engine, prompt, streams, n))
                    print(f"  rep {r + 1}: groups {g}, {streams} streams: {runs[f'groups{g}-streams{streams}'][-1]:.1f}"
                          " tok/s", flush=True)
        for g, engine in engines.items():
            engine.stop()
            pipes[g].shutdown()
        return {k: statistics.median(v) for k, v in runs.items()}
    finally:
        worker.stop()


# --- part 2: open-loop Poisson arrivals against the HTTP server ----------------------------------


def part2(folder: Path, rates: list[float], count: int, tokens: int, pin: bool,
          workers: bool = True) -> list[dict[str, float]]:
    """The HTTP load at each rate against `shardline serve` on `folder`: stage 1 on a worker
    (pinned: a core each), or (`workers` False) every stage in the server's process."""
    threads = "1" if pin and workers else "2"
    worker = Proc(["worker", "--shards", str(folder), "--stage", "1", "--listen", "127.0.0.1:0",
                   "--threads", threads, "--insecure"], "listening on ", cpus="1" if pin else None) if workers else None
    chain = ["--workers", worker.addr] if worker is not None else []
    server = Proc(["serve", "--shards", str(folder), *chain, "--port", "0", "--insecure",
                   "--model-id", "m", "--threads", threads, "--max-streams", "8"], "serving ",
                  cpus="0" if pin and workers else None, stream="stderr")
    url = server.url + "/completions"
    try:
        rows = []
        for rate in rates:
            row = asyncio.run(load(url, "m", rate, count, tokens, seed=int(rate * 1000)))
            rows.append(row)
            print("  " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        return rows
    finally:
        server.stop()
        if worker is not None:
            worker.stop()


def runners(work: Path, balance: bool, rates: list[float], count: int, tokens: int) -> int:
    """Part 2 on the stateful and the paged export side by side, in one process and over a worker."""
    folders = {"stateful": shard_folder(work, 2, balance=balance), "paged": shard_folder(work, 2, balance=balance,
                                                                                        paged=True)}
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    for placement in ("process", "workers"):
        for system, folder in folders.items():
            print(f"{system}, {placement}: open-loop HTTP load", flush=True)
            got[system, placement] = part2(folder, rates, count, tokens, pin=placement == "workers",
                                           workers=placement == "workers")
    print(f"\n{'system':>9} {'placement':>9} {'req/s':>6} {'tok/s':>7} {'ttft_p50':>9} {'ttft_p90':>9} "
          f"{'tpot_p50':>9} {'tpot_p90':>9} {'e2e_p50':>9}")
    for (system, placement), rows in got.items():
        for r in rows:
            print(f"{system:>9} {placement:>9} {r['rate']:6.1f} {r['throughput_tok_s']:7.1f} "
                  + " ".join(f"{r[k]:9.1f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
                                                       "e2e_p50_ms")))
    figures: dict[str, object] = {}
    for placement in ("process", "workers"):
        for new, old in zip(got["paged", placement], got["stateful", placement], strict=True):
            at = f"{placement}_rate{new['rate']:g}"
            figures[f"{at}_tok_s_paged_vs_stateful"] = round(new["throughput_tok_s"] / old["throughput_tok_s"], 3)
            for k in ("ttft", "tpot", "e2e"):
                figures[f"{at}_{k}_p50_paged_vs_stateful"] = round(new[f"{k}_p50_ms"] / old[f"{k}_p50_ms"], 3)
    figures |= {"tokens": tokens, "requests": count, "http": {f"{s}-{p}": rows for (s, p), rows in got.items()}}
    print(json.dumps(figures))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-pin", action="store_true", help="let both processes use both cores")
    p.add_argument("--even", action="store_true", help="split layers evenly instead of by work per token")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    p.add_argument("--runners", action="store_true", help="part 2 only: the paged export against the stateful one")
    args = p.parse_args()
    n, reps, count = (24, 1, 8) if args.quick else (64, 3, 24)
    rates = [0.5, 2.0] if args.quick else [0.5, 1.0, 2.0, 4.0]
    if args.runners:
        return runners(args.work, not args.even, rates, count, n)
    pin = not args.no_pin
    if pin:  # before OpenVINO starts its threads: they inherit it. The worker gets core 1.
        os.sched_setaffinity(0, {0})
    folder = shard_folder(args.work, 2, balance=not args.even)
    prompt = ChatTokenizer(folder).encode_chat([{"role": "user", "content": PROMPT}])
    print(f"part 1: engine on 2 stages in 2 processes ({'1 core each' if pin else 'shared cores'}), {n} tokens")
    agg = part1(folder, prompt, n, reps, pin)
    print("part 2: open-loop HTTP load (Poisson arrivals), completions, stream")
    rows = part2(folder, rates, count, n, pin)
    groups = sorted({int(k.split("-")[0][6:]) for k in agg})
    print(f"\n{'streams':>8}" + "".join(f"{'groups ' + str(g):>10}" for g in groups)
          + "".join(f"{'x1 g' + str(g):>8}" for g in groups) + f"{'g1/g0':>8}")
    for s in (1, 2, 4, 8):
        row = [agg[f"groups{g}-streams{s}"] for g in groups]
        print(f"{s:>8}" + "".join(f"{v:10.1f}" for v in row)
              + "".join(f"{agg[f'groups{g}-streams{s}'] / agg[f'groups{g}-streams1']:8.2f}" for g in groups)
              + f"{row[1] / row[0]:8.2f}")
    print(f"\n{'req/s':>6} {'tok/s':>7} " + " ".join(f"{m + '_p' + str(q):>10}" for m in ("ttft", "tpot", "e2e")
                                                   for q in (50, 90, 99)) + f" {'lag_p99':>8} {'cli_cpu':>8}")
    for r in rows:
        print(f"{r['rate']:6.1f} {r['throughput_tok_s']:7.1f} " + " ".join(
            f"{r[f'{m}_p{q}_ms']:10.1f}" for m in ("ttft", "tpot", "e2e") for q in (50, 90, 99))
            + f" {r['client_lag_p99_ms']:8.2f} {r['client_cpu_per_req_ms']:8.2f}")
    figures: dict[str, object] = {f"groups{g}_streams{s}_vs_1": round(agg[f"groups{g}-streams{s}"]
                                                                      / agg[f"groups{g}-streams1"], 3)
                                  for g in groups for s in (2, 4, 8)}
    figures |= {f"groups{g}_vs_groups0_streams{s}": round(agg[f"groups{g}-streams{s}"] / agg[f"groups0-streams{s}"], 3)
                for g in groups[1:] for s in (1, 2, 4, 8)}
    figures |= {"pinned": pin, "balanced": not args.even, "tokens": n, "reps": reps, "decode_tok_s": agg, "http": rows}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
