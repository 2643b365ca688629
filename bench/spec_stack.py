"""Speculative decoding (issue 10), the full stack: many streams in decode groups, speculating,
against a naive pipeline (one stream, no speculation, the full logits row of every token back).

The full stack against a naive pipeline, on 2 worker processes (a 3-stage export) with the relay capped at
`--rate-mbit` per direction, at each delay: naive = one stream, no speculation, the full
logits row of every token returned (`want_logits`); full = `--streams` streams at once in
decode groups (the serve default: one group per stage), speculating with `--source`
(default: prompt lookup; bench/speculative.py measures which source is best),
top-1 returned. Also, to split the gain: one stream top-1 without speculation, and the
streams in groups without speculation. Several streams' figure: aggregate tok/s = tokens
after each stream's first / (last stream's last token - first stream's first token), which
the slowest stream of the burst sets; also the sum of each stream's own tok/s.

The relay sits on every hop (coordinator -> worker 1, worker 1 -> worker 2, and worker 2's answer
back: 3 delays per step). Greedy; stop tokens honoured unless `--ignore-stops`.

    python bench/spec_stack.py --quick
    python bench/spec_stack.py --delays 0,20

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kit import relays, worker  # bench/ is on sys.path when this script runs
from spec_kit import (
    Engines,
    LoadWatch,
    aggregate_tok_s,
    common_flags,
    engines,
    f,
    git_state,
    med,
    provenance,
    rounded,
    run_all,
    setup,
    show,
    spec_totals,
)

from shardline.config import SamplingConfig, SpeculationConfig
from shardline.serving.engine import Engine, Request


def measure_stack(naive: Engine, full: Engine, prompts: dict[str, list[int]], n: int, streams: int, rounds: int,
                  stops: frozenset[int], label: str, deadline: float) -> dict[str, list[dict[str, Any]]]:
    """Per round: naive (1 stream, full logits), top1 (1 stream), groups (`streams` streams, no
    speculation), full (`streams` streams speculating); the prompt types rotate over rounds."""
    types = list(prompts)

    def batch(r: int) -> list[list[int]]:
        return [prompts[types[(streams * r + i) % len(types)]] for i in range(streams)]

    def one(name: str, r: int) -> dict[str, Any]:
        if name == "naive":
            runs = run_all(naive, [Request(batch(r)[0], SamplingConfig(max_tokens=n, want_logits=True), stops)])
        elif name == "top1":
            runs = run_all(naive, [Request(batch(r)[0], SamplingConfig(max_tokens=n), stops)])
        else:
            runs = run_all(full, [Request(p, SamplingConfig(max_tokens=n), stops, speculative=name == "full")
                                  for p in batch(r)])
        return {"tok_s": aggregate_tok_s(runs), "per_stream_tok_s": med([x.tok_s for x in runs]),
                "sum_tok_s": sum(x.tok_s for x in runs),
                "tokens": sum(len(x.tokens) for x in runs)} | (spec_totals(runs) if name == "full" else {})

    systems = ["naive", "top1", "groups", "full"]
    for name in systems:  # warm-up
        one(name, 0)
    got: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(rounds):
        if r and time.monotonic() > deadline:
            print(f"  {label}: time box, stopping after {r} rounds", file=sys.stderr)
            break
        for name in (systems if r % 2 == 0 else systems[::-1]):
            got[name].append(one(name, r))
        print(f"  {label} round {r + 1}/{rounds}: " + ", ".join(f"{s} {got[s][-1]['tok_s']:.1f}" for s in systems)
              + f" tok/s; full/naive {got['full'][-1]['tok_s'] / got['naive'][-1]['tok_s']:.2f}x",
              file=sys.stderr, flush=True)
    return got


def summarize_stack(got: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    naive = got["naive"]
    out: dict[str, Any] = {}
    for s, xs in got.items():
        out[s] = {"tok_s": med([x["tok_s"] for x in xs]),
                  "vs_naive": med([x["tok_s"] / a["tok_s"] for a, x in zip(naive, xs, strict=False)]),
                  "per_stream_tok_s": med([x["per_stream_tok_s"] for x in xs]),
                  "sum_tok_s": med([x["sum_tok_s"] for x in xs]),
                  "sum_vs_naive": med([x["sum_tok_s"] / a["tok_s"] for a, x in zip(naive, xs, strict=False)])}
    full = got["full"]
    drafted, accepted, steps = (sum(x["drafted"] for x in full), sum(x["accepted"] for x in full),
                                sum(x["steps"] for x in full))
    out["full"] |= {"acceptance": accepted / drafted if drafted else 0.0, "k_mean": drafted / steps if steps else 0.0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 types, 0 ms only, 16 tokens, 1 round")
    common_flags(p, "")
    p.add_argument("--source", default="ngram", help="the full stack's draft source (ngram, int8, int4, layers:L, "
                   "an export folder)")
    p.add_argument("--delays", default="0,20,50,100", help="ms per hop through the relay")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--far-tokens", type=int, default=48, help="tokens per request at delays >= --far-from")
    p.add_argument("--far-from", type=float, default=20.0)
    p.add_argument("--k", default="auto", help="drafts per verify step: auto or a number")
    p.add_argument("--streams", type=int, default=4, help="streams of the full stack")
    p.add_argument("--groups", type=int, default=None, help="decode groups (default: the serve default, one "
                   "per stage with workers)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="relay bandwidth cap per direction")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    delays = [float(d) for d in args.delays.split(",") if d]
    n, far_n, rounds = args.tokens, args.far_tokens, args.rounds
    if args.quick:
        delays, n, far_n, rounds = [0.0], 16, 16, 1
    if n < 3 or far_n < 3:
        p.error("--tokens and --far-tokens must be at least 3")
    k = None if args.k == "auto" else int(args.k)
    s = setup(p, args, args.quick)
    watch, git = LoadWatch(), git_state()
    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    procs = []
    try:
        procs = [worker(s.f3, 1), worker(s.f3, 2)]
        addrs = [w.addr for w in procs]
        for d in delays:
            if time.monotonic() > s.deadline:
                skipped.append(f"{d:g} ms")
                continue
            m = far_n if d >= args.far_from else n
            eng: Engines
            with relays(addrs, d, args.rate_mbit) as via, engines() as eng:
                naive = eng.open("naive", s.f3, via, SpeculationConfig(), args.groups)
                full = eng.open("full", s.f3, via, s.spec_cfg(args.source, k), args.groups)
                got = measure_stack(naive, full, s.prompts, m, args.streams, rounds, s.stops, f"stack {d:g} ms",
                                    s.deadline)
            results[f"{d:g}ms"] = summarize_stack(got) | {"tokens": m}
    finally:
        for w in procs:
            w.stop()

    ran = provenance(s, watch, git)
    headers = ["delay/hop", "tokens", "naive tok/s", "top-1 1 stream", "groups no spec", "full stack",
               "full / naive", "groups / naive", "top-1 / naive", "full acc", "full K", "full sum / naive"]
    rows = [[d, str(x["tokens"]), f(x["naive"]["tok_s"], ".1f"), f(x["top1"]["tok_s"], ".1f"),
             f(x["groups"]["tok_s"], ".1f"), f(x["full"]["tok_s"], ".1f"), f(x["full"]["vs_naive"]),
             f(x["groups"]["vs_naive"]), f(x["top1"]["vs_naive"]), f(x["full"]["acceptance"]),
             f(x["full"]["k_mean"], ".1f"), f(x["full"]["sum_vs_naive"])] for d, x in results.items()]
    groups = args.groups if args.groups is not None else "default"
    show(f"full stack ({args.streams} streams, decode groups {groups}, speculation {args.source}, top-1) vs naive "
         f"(1 stream, no speculation, full logits), 2 workers, relay capped at {args.rate_mbit:g} Mbit/s; aggregate "
         "tok/s (the burst's tokens over its first to last token: the slowest stream sets it); sum = each stream's "
         "own tok/s added; ratios: medians of per-round ratios", headers, rows)
    if skipped:
        print(f"time box: skipped {', '.join(skipped)}")
    figures: dict[str, Any] = {f"ratio_full_stack_vs_naive_{at}": round(x["full"]["vs_naive"], 3)
                               for at, x in results.items()}
    if "100ms" in results:
        figures["targets_met"] = {"full_stack_ge_8x_naive_at_100ms": results["100ms"]["full"]["vs_naive"] >= 8}
    figures |= {"tokens": n, "far_tokens": far_n, "rounds": rounds, "source": args.source, "streams": args.streams,
                "rate_mbit": args.rate_mbit, "skipped": skipped} | ran
    figures["stack"] = rounded(results)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
