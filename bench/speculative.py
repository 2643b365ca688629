"""Speculative decoding (issue 10): speedup over plain decoding and acceptance, per prompt type and
per draft source, in process and on 2 worker processes at several delays per hop. (The full stack
against a naive pipeline and sampled drafts were spec_stack.py and spec_sampled.py, retired in
issue 41: their figures are in BENCHMARKS.md, issue 10.)

Draft sources (`--sources`, comma-separated):
  ngram     prompt lookup (n-gram matches in the prompt and the text so far; no model)
  int8      the target model itself exported with int8 weights as one stage (a compressed copy:
            no smaller model sharing SmolLM2's tokenizer is available offline)
  int4      the same with int4 weights
  layers:L  self-speculation: the target's first L of 30 layers, its final norm and head
  PATH      any one-stage export folder sharing the target's tokenizer
K is auto (`--k auto`, chosen per stream from its measured acceptance and step cost, at most
`--k-max`) unless a number is given.

Each prompt type through plain decoding (an engine without speculation) and
    through an engine per draft source, one request at a time, greedy, in process (the default
    2-stage balanced gguf export, every stage on its own thread) and on 2 worker processes (a
    3-stage export: stage 0 and the drafter in this process, stages 1 and 2 on one worker each,
    a daisy chain) with `shardline relay` on every hop (coordinator -> worker 1, worker 1 ->
    worker 2, and worker 2's answer back: 3 delays per step) at each of `--delays` ms. Tok/s
    of generation excluding prefill (first token to last); speedup = the median over rounds of
    spec tok/s / plain tok/s in the same round (the systems run one after the other on each
    type, their order alternating per round). Acceptance = drafts that stood / drafts offered;
    K = drafts offered per verify step (SpecStats: drafted / steps).
Stop tokens are honoured by default (`--ignore-stops` to generate exactly `--tokens`): speculation
is exact under greedy decoding, so plain and speculative runs generate the same tokens (checked:
"same"), and their tok/s compare. At delays >= `--far-from` ms runs generate `--far-tokens`
tokens with `--far-rounds` rounds (a plain token costs 3 trips there).

    python bench/speculative.py --quick
    python bench/speculative.py                          # every source and delay (~40 min on 2 cores)
    python bench/speculative.py --delays 0,100 --types chat,code --sources ngram,layers:8
    python bench/speculative.py --model qwen2.5-coder-1.5b --sources qwen2.5-coder-0.5b,ngram --types code,edit,chat

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kit import relays, worker  # bench/ is on sys.path when this script runs
from spec_kit import (
    LoadWatch,
    common_flags,
    engines,
    f,
    git_state,
    measure_spec,
    print_spec,
    provenance,
    rounded,
    setup,
    show,
    summarize_spec,
)

from shardline.config import SpeculationConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 types, 0 ms only, 16 tokens, 1 round")
    common_flags(p, "ngram,int8,int4,layers:24")
    p.add_argument("--delays", default="0,20,50,100", help="ms per hop through the relay (workers)")
    p.add_argument("--no-inproc", action="store_true", help="skip the in-process placement")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--far-tokens", type=int, default=48, help="tokens per request at delays >= --far-from")
    p.add_argument("--far-from", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--far-rounds", type=int, default=2)
    p.add_argument("--k", default="auto", help="drafts per verify step: auto or a number")
    p.add_argument("--llama-server", type=Path, help="with --model and a draft of `shardline pull` among --sources: "
                                                     "llama.cpp's own speculative decoding with the same pair, "
                                                     "side by side (bench/llama_spec.py)")
    args = p.parse_args()
    delays = [float(d) for d in args.delays.split(",") if d]
    n, far_n, rounds, far_rounds = args.tokens, args.far_tokens, args.rounds, args.far_rounds
    if args.quick:
        delays, n, far_n, rounds, far_rounds = [0.0], 16, 16, 1, 1
    if n < 3 or far_n < 3:
        p.error("--tokens and --far-tokens must be at least 3")
    k = None if args.k == "auto" else int(args.k)
    s = setup(p, args, args.quick)
    watch, git = LoadWatch(), git_state()
    sources = list(s.drafts)
    systems = ["plain", *sources]

    def tokens_at(delay: float | None) -> tuple[int, int]:
        return (far_n, far_rounds) if delay is not None and delay >= args.far_from else (n, rounds)

    results: dict[str, dict[str, Any]] = {}  # placement -> summary
    tokens: dict[str, int] = {}
    skipped: list[str] = []
    llama: dict[str, Any] | None = None
    if args.llama_server and args.model:  # first: a failure there shows before the long shardline runs
        llama = llama_pair(args, sources, s.prompts, n, rounds)
    if not args.no_inproc:
        with engines() as eng:
            eng.open("plain", s.f2, None, SpeculationConfig())
            for src in sources:
                eng.open(src, s.f2, None, s.spec_cfg(src, k))
            runs = measure_spec(eng, systems, s.prompts, n, rounds, s.stops, "in process", s.deadline)
        results["inproc"], tokens["inproc"] = summarize_spec(runs, sources), n
    if delays:
        procs = []
        try:
            procs = [worker(s.f3, 1), worker(s.f3, 2)]
            addrs = [w.addr for w in procs]
            for d in delays:
                if time.monotonic() > s.deadline:
                    skipped.append(f"workers {d:g} ms")
                    continue
                m, rr = tokens_at(d)
                with relays(addrs, d) as via, engines() as eng:
                    eng.open("plain", s.f3, via, SpeculationConfig())
                    for src in sources:
                        eng.open(src, s.f3, via, s.spec_cfg(src, k))
                    runs = measure_spec(eng, systems, s.prompts, m, rr, s.stops, f"workers {d:g} ms", s.deadline)
                results[f"workers-{d:g}ms"], tokens[f"workers-{d:g}ms"] = summarize_spec(runs, sources), m
        finally:
            for w in procs:
                w.stop()

    ran = provenance(s, watch, git)
    target = f"{args.model} (" if args.model else "default model (SmolLM2-135M, "
    print(f"{target}gguf weights, exact precision), greedy, stop tokens "
          f"{'ignored' if args.ignore_stops else 'honoured'}, K {args.k} (max {args.k_max})")
    for place, x in results.items():
        print_spec(place, x, sources, tokens[place], tokens_at(None if place == "inproc" else float(place[8:-2]))[1])
    if results:
        headers = ["placement"] + [f"{src}: mean x" for src in sources] + ["best"]
        rows = []
        for place, x in results.items():
            best = max(sources, key=lambda src: x["sources"][src]["mean_speedup"])
            rows.append([place] + [f(x["sources"][src]["mean_speedup"]) for src in sources] + [best])
        show("mean speedup over the prompt types", headers, rows)
    if skipped:
        print(f"time box: skipped {', '.join(skipped)}")
    if llama is not None:
        show("llama.cpp's speculative decoding with the same pair (llama-server -md, its defaults)",
             ["type", "plain tok/s", "spec tok/s", "speedup", "acceptance", "same"],
             [[t, f(r["plain_tok_s"], ".1f"), f(r["spec_tok_s"], ".1f"), f(r["speedup"]), f(r["acceptance"]),
               f"{r['same']}/{r['runs']}"] for t, r in llama["types"].items()] + [
                 ["mean", "", "", f(llama["mean_speedup"]), "", ""]])

    figures: dict[str, Any] = {}
    for place, x in results.items():
        best = max(sources, key=lambda src: x["sources"][src]["mean_speedup"])
        figures[f"ratio_best_mean_speedup_{place}"] = round(x["sources"][best]["mean_speedup"], 3)
        figures[f"best_source_{place}"] = best
    targets: dict[str, Any] = {}
    for place in ("inproc", "workers-0ms"):
        if place in results:
            targets[f"mean_speedup_ge_1.5_{place}"] = figures[f"ratio_best_mean_speedup_{place}"] >= 1.5
    far = [p_ for p_ in results if p_.startswith("workers-") and float(p_[8:-2]) >= 20]
    if far:
        targets["mean_speedup_ge_3_at_20ms_and_beyond"] = all(figures[f"ratio_best_mean_speedup_{p_}"] >= 3
                                                              for p_ in far)
    if llama is not None and "inproc" in results:
        figures["ratio_inproc_speedup_over_llama_cpp_speedup"] = round(
            figures["ratio_best_mean_speedup_inproc"] / llama["mean_speedup"], 3)
        figures["llama_cpp_mean_speedup"] = round(llama["mean_speedup"], 3)
        figures["llama_cpp"] = rounded(llama)
    figures["targets_met"] = targets
    figures["model"] = args.model or "SmolLM2-135M (embedded)"
    figures |= {"tokens": n, "far_tokens": far_n, "far_from_ms": args.far_from, "rounds": rounds,
                "far_rounds": far_rounds, "stops_honoured": not args.ignore_stops, "k": args.k, "k_max": args.k_max,
                "skipped": skipped} | ran
    figures["spec"] = rounded(results)
    print(json.dumps(figures))
    return 0


def llama_pair(args: argparse.Namespace, sources: list[str], prompts: dict[str, list[int]], n: int,
               rounds: int) -> dict[str, Any] | None:
    from llama_spec import measure

    from shardline.export.pull import pull, resolve_model
    from shardline.model.catalog import CATALOG, named

    draft = next((src for src in sources if src in CATALOG), None)
    target = resolve_model(Path(args.model))
    if draft is None or target is None:
        print("--llama-server: no draft of `shardline pull` among --sources: left out", file=sys.stderr)
        return None
    return measure(args.llama_server, target, pull(named(draft)), prompts, n, rounds, 2, args.work)


if __name__ == "__main__":
    sys.exit(main())
