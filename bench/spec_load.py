"""Speculation under load (issue 10, item 4): is a server with speculation on (auto K) ever slower
than with it off? Aggregate decode tokens/s of N concurrent streams, N = 1, 2, 4, 8, through
one engine (decode groups as `shardline serve` sets them), speculation off vs drafts (prompt
lookup by default) with auto K vs a fixed K, side by side; the settings interleave within each
round; medians.

In process by default (every stage on its own thread, the default 2-stage gguf export); with
--workers N the stages after 0 run on N worker processes on 127.0.0.1 (a 1+N-stage export),
optionally behind `shardline relay` with --delay-ms per hop.

    python bench/spec_load.py --quick
    python bench/spec_load.py --streams 1,2,4,8 --rounds 3
    python bench/spec_load.py --draft int8 --workers 2   # a draft model on the coordinator

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from kit import Proc, relay, shard_folder, worker  # bench/ is on sys.path when this script runs
from spec_kit import draft_path

from shardline.config import RunConfig, SamplingConfig, ServeConfig, SpeculationConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_engine
from shardline.serving.engine import Engine, Event, Request

TEXTS = [
    "Rewrite this more formally: the meeting got moved to friday because the boss was sick, so bring the reports.",
    "Write a Python function that parses a CSV line into a list of fields, handling quoted commas.",
    "List ten countries in Europe with their capitals, one per line.",
    "Explain in a short paragraph how a refrigerator keeps food cold.",
    "Summarize: The committee met on Tuesday and agreed to extend the library's opening hours on weekends.",
    "Translate into French: I would like a table for two by the window, please.",
    "Write a short poem about the sea at night.",
    "What is 17 times 23? Explain the steps.",
]


def burst(engine: Engine, prompts: list[list[int]], tokens: int, timeout_s: float) -> tuple[float, float]:
    """Every prompt at once; (aggregate decode tok/s from the first token to the last of each
    stream, summed over streams / the common window, acceptance over the streams)."""
    firsts: list[float] = [0.0] * len(prompts)
    lasts: list[float] = [0.0] * len(prompts)
    counts = [0] * len(prompts)
    drafted, accepted = [0], [0]
    done = threading.Semaphore(0)

    def on(i: int) -> Any:
        def event(ev: Event) -> None:
            now = time.perf_counter()
            if ev.token is not None:
                counts[i] += 1
                firsts[i] = firsts[i] or now
                lasts[i] = now
                return
            if ev.spec is not None:
                drafted[0] += ev.spec.drafted
                accepted[0] += ev.spec.accepted
            done.release()
        return event

    for i, p in enumerate(prompts):
        engine.submit(Request(p, SamplingConfig(max_tokens=tokens), frozenset()), on(i))
    for _ in prompts:
        if not done.acquire(timeout=timeout_s):
            raise RuntimeError("a burst did not finish in time")
    window = max(lasts) - min(firsts)
    return (sum(counts) - len(prompts)) / window, accepted[0] / drafted[0] if drafted[0] else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fixed-k", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0, help="worker processes for stages 1..N (0: in process)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="relay delay per hop (with --workers)")
    ap.add_argument("--draft", default="ngram", help="ngram (default), int8, int4, layers:L or an export folder")
    ap.add_argument("--quick", action="store_true", help="1 and 4 streams, 32 tokens, 1 round")
    args = ap.parse_args()
    streams = [1, 4] if args.quick else [int(x) for x in args.streams.split(",")]
    tokens, rounds = (32, 1) if args.quick else (args.tokens, args.rounds)
    folder = shard_folder(args.work, 1 + args.workers if args.workers else 2, balance=not args.workers)
    tok = ChatTokenizer(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    draft = draft_path(args.draft, args.work)
    settings = {"off": SpeculationConfig(), "auto": SpeculationConfig(draft=draft),
                f"k{args.fixed_k}": SpeculationConfig(draft=draft, k=args.fixed_k)}
    procs: list[Proc] = []
    try:
        addrs = _workers(folder, args.workers, args.delay_ms, procs)
        engines = {name: open_engine(folder, RunConfig(), ServeConfig(max_streams=max(streams)), addrs or None,
                                     spec=spec)[0] for name, spec in settings.items()}
        rates: dict[tuple[str, int], list[float]] = {}
        accept: dict[tuple[str, int], list[float]] = {}
        for n in streams:
            for engine in engines.values():  # warm-up: the first burst compiles and fills caches
                burst(engine, [prompts[i % len(prompts)] for i in range(n)], 8, 600)
            for r in range(rounds):
                for name, engine in engines.items():
                    rate, acc = burst(engine, [prompts[(i + r) % len(prompts)] for i in range(n)], tokens, 1200)
                    rates.setdefault((name, n), []).append(rate)
                    accept.setdefault((name, n), []).append(acc)
        for engine in engines.values():
            engine.stop()
            engine.pipe.shutdown()
    finally:
        for p in procs:
            p.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    names = list(settings)
    print(f"{'streams':>7} " + " ".join(f"{n + ' tok/s':>12}" for n in names) + " " +
          " ".join(f"{n + '/off':>9}" for n in names[1:]) + f" {'acceptance':>10}")
    for n in streams:
        print(f"{n:>7} " + " ".join(f"{med[(m, n)]:>12.1f}" for m in names) + " " +
              " ".join(f"{med[(m, n)] / med[('off', n)]:>9.2f}" for m in names[1:]) +
              f" {statistics.median(accept[('auto', n)]):>10.2f}")
    figures: dict[str, float] = {}
    for m in names[1:]:
        figures |= {f"{m}_over_off_{n}": round(med[(m, n)] / med[("off", n)], 3) for n in streams}
    figures |= {f"{m}_tok_s_{n}": round(med[(m, n)], 2) for m in names for n in streams}
    figures |= {"draft": args.draft, "workers": args.workers, "delay_ms": args.delay_ms, "tokens": tokens,
                "rounds": rounds}
    print(json.dumps(figures))


def _workers(folder: Path, n: int, delay_ms: float, procs: list[Proc]) -> list[str]:
    """n workers for stages 1..n, each behind a relay when delay_ms > 0; their addresses in order."""
    addrs = []
    for stage in range(1, n + 1):
        w = worker(folder, stage)
        procs.append(w)
        addr = w.addr
        if delay_ms:
            r = relay(addr, delay_ms)
            procs.append(r)
            addr = r.addr
        addrs.append(addr)
    return addrs


if __name__ == "__main__":
    main()
