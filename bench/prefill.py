"""Chunked prefill (issue 9): prefill speed against chunk size, what a long prompt does to running
streams, and what computing the lm_head at the last position only saves.

All parts run the default model's 2-stage gguf export (balanced, as `shardline serve` uses it) in
this process (LocalPipeline, every stage on its own thread), exact precision (the serve default),
2 OpenVINO threads. Prompts are a plain English text repeated to the length asked for.

(a) prefill tok/s for every chunk size x prompt length: the time from the first chunk's
    submission to the first token, with one chunk in flight at a time (as the scheduler runs a
    prompt: the next chunk is planned when the previous one's outcome is back). Reps interleave
    the chunk sizes; medians. Also, at one length, every chunk submitted at once (stage 0 works
    on chunk k+1 while stage 1 works on chunk k), to show what one-in-flight costs.
(b) the decode stall: an engine with one decode group (the local serve default); 4 streams
    decode steadily (stop tokens ignored), then a long prompt arrives. For the running streams,
    the inter-token gaps that overlap the prompt's prefill window (its submission to its first
    token) against those wholly before or after it; the prompt's TTFT. Whole prefill (chunk >=
    the prompt) against chunked. Reps interleave the settings; medians of each rep's figure.
(c) the knee: the smallest chunk whose tok/s is within `--knee` of the best chunk's at every
    length >= 1024 (printed as a suggestion; the choice weighs (b) too: BENCHMARKS.md).
(d) the lm_head at every prompt position ("before": the last stage is given logits_index = all
    positions of each step, what the graph computed before manifest format 2) against the last
    position only ("after"): TTFT (the prefill's wall time through the pipeline; the whole
    prompt in one step, and chunked at the default) and peak RSS, each case in a fresh process.

    python bench/prefill.py --quick
    python bench/prefill.py                       # every part
    python bench/prefill.py --parts a,c           # only some

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from itertools import count
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from kit import TEXT, shard_folder  # bench/ is on sys.path when this script runs
from trackers import Tracker, wait_for

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig, SamplingConfig, SamplingParams
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome, Pipeline, prefill, run
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Request, Ticket
from shardline.serving.scheduler import SchedulerConfig
from shardline.stage.cache import KVBook, StepInputs
from shardline.stage.runner import StageRunner

CHUNKS = (16, 32, 64, 128, 256, 512, 1024)
LENGTHS = (128, 512, 1024, 2048, 4096)
GREEDY = SamplingParams()
KEYS = count(1_000_000)
CHATS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a bicycle stays upright.", "List five uses of a paperclip.",
         "What is the capital of France?"]


def text_prompt(folder: Path, n: int) -> list[int]:
    ids = ChatTokenizer(folder).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def parts(prompt: list[int], chunk: int) -> list[list[int]]:
    return [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]


def prefill_s(pipe: Pipeline, prompt: list[int], chunk: int, pipelined: bool = False) -> float:
    """Seconds from the first chunk's submission to the first token. One chunk in flight (the
    next planned once the previous one is back), or with `pipelined` every chunk at once."""
    key, book = next(KEYS), KVBook()
    pieces = parts(prompt, chunk)

    def step(i: int) -> Any:
        return prefill(key, book, pieces[i], GREEDY, first=i == 0, last=i == len(pieces) - 1)

    start = time.perf_counter()
    try:
        if pipelined:
            for i in range(len(pieces)):
                pipe.submit(step(i))
            got: list[Outcome] = []
            deadline = time.monotonic() + 600
            while len(got) < len(pieces) and time.monotonic() < deadline:
                got += pipe.outcomes(timeout=10)
            outs = got[-1:]
            if len(got) < len(pieces):
                raise RuntimeError("prefill did not finish within 600 s")
        else:
            for i in range(len(pieces)):
                outs = run(pipe, step(i))
        took = time.perf_counter() - start
    finally:
        pipe.release(key)
    if outs[0].failed or not outs[0].choices:
        raise RuntimeError(f"prefill failed: {outs[0].error}")
    return took


def all_positions_head(stage: StageRunner) -> None:
    """Bench only: make the last stage compute the lm_head at every position of every step (what
    the graph did before manifest format 2), then hand back the positions that were asked for."""
    inner = stage.run

    def run_all(key: Any, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray:
        b, t = inputs.rows, inputs.new_tokens
        want = inputs.logits_index if inputs.logits_index is not None else np.full((b, 1), t - 1, np.int64)
        every = np.tile(np.arange(t, dtype=np.int64), (b, 1))
        out = inner(key, replace(inputs, logits_index=every), hidden)
        return out[np.arange(b)[:, None], want]

    stage.run = run_all  # type: ignore[method-assign]


# --- (a) prefill speed against chunk size ----------------------------------------------------------


def part_a(pipe: LocalPipeline, folder: Path, chunks: list[int], lengths: list[int], reps: int,
           pipelined_at: int | None) -> dict[str, Any]:
    prompts = {n: text_prompt(folder, n) for n in lengths}
    for c in chunks:  # warm-up: the first calls of each chunk shape
        prefill_s(pipe, prompts[min(lengths)][: 2 * c] if 2 * c <= min(lengths) else prompts[min(lengths)], c)
    secs: dict[tuple[int, int], list[float]] = {}
    piped: dict[int, list[float]] = {}
    for r in range(reps):
        for n in lengths:
            order = chunks if r % 2 == 0 else chunks[::-1]
            for c in order:
                secs.setdefault((n, c), []).append(prefill_s(pipe, prompts[n], c))
                if n == pipelined_at:
                    piped.setdefault(c, []).append(prefill_s(pipe, prompts[n], c, pipelined=True))
            print(f"  (a) rep {r + 1}/{reps} length {n}: " + " ".join(
                f"{c}:{n / secs[n, c][-1]:.0f}" for c in chunks) + " tok/s", file=sys.stderr, flush=True)
    tps = {f"{n}-{c}": n / statistics.median(v) for (n, c), v in secs.items()}
    piped_tps = {str(c): pipelined_at / statistics.median(v) for c, v in piped.items()} if pipelined_at else {}
    return {"tok_s": tps, "pipelined_tok_s": piped_tps, "pipelined_length": pipelined_at}


def knee(a: dict[str, Any], chunks: list[int], lengths: list[int], within: float) -> int:
    """The smallest chunk within `within` of the best chunk's tok/s at every length >= 1024 (or
    the longest lengths measured)."""
    long = [n for n in lengths if n >= 1024] or [max(lengths)]
    for c in sorted(chunks):
        if all(a["tok_s"][f"{n}-{c}"] >= (1 - within) * max(a["tok_s"][f"{n}-{x}"] for x in chunks) for n in long):
            return c
    return max(chunks)


def print_a(a: dict[str, Any], chunks: list[int], lengths: list[int]) -> None:
    tps = a["tok_s"]
    print("\n(a) prefill tok/s (first chunk submitted -> first token), one chunk in flight; rows: prompt "
          "tokens, columns: chunk")
    print(f"{'prompt':>7}" + "".join(f"{c:>8}" for c in chunks) + f"{'best':>8}")
    for n in lengths:
        best = max(chunks, key=lambda c: tps[f"{n}-{c}"])
        print(f"{n:>7}" + "".join(f"{tps[f'{n}-{c}']:>8.0f}" for c in chunks) + f"{best:>8}")
    print("ratio to the best chunk at that length")
    for n in lengths:
        top = max(tps[f"{n}-{c}"] for c in chunks)
        print(f"{n:>7}" + "".join(f"{tps[f'{n}-{c}'] / top:>8.2f}" for c in chunks))
    if a["pipelined_tok_s"]:
        n = a["pipelined_length"]
        print(f"every chunk submitted at once, prompt {n}: tok/s, and / one in flight")
        print(f"{'':>7}" + "".join(f"{a['pipelined_tok_s'][str(c)]:>8.0f}" for c in chunks))
        print(f"{'':>7}" + "".join(f"{a['pipelined_tok_s'][str(c)] / tps[f'{n}-{c}']:>8.2f}" for c in chunks))


# --- (b) the decode stall while a long prompt arrives ---------------------------------------------


def stall_once(engine: Engine, chats: list[list[int]], long: list[int], lead_s: float) -> dict[str, float]:
    """4 streams decode; `lead_s` later the long prompt arrives; `lead_s` after its first token the
    streams are cancelled. Gaps between consecutive tokens of a running stream: "in" if the gap
    overlaps the prefill window [submitted, first token], "out" if wholly outside it (and after
    every stream's first few tokens, so joining the group is not counted)."""
    trackers = [Tracker() for _ in chats]
    tickets: list[Ticket] = []
    try:
        for c, t in zip(chats, trackers, strict=True):
            tickets.append(engine.submit(Request(c, SamplingConfig(max_tokens=4000), frozenset()), t))
        wait_for(lambda: all(len(t.times) >= 8 for t in trackers), 120, "the streams did not start")
        steady = time.perf_counter()
        time.sleep(lead_s)
        arrival = Tracker()
        submitted = time.perf_counter()
        engine.submit(Request(long, SamplingConfig(max_tokens=1), frozenset()), arrival)
        if not arrival.done.wait(600) or not arrival.times:
            raise RuntimeError(f"the long prompt did not finish: {arrival.finish}")
        first = arrival.times[0]
        time.sleep(lead_s)
        end = time.perf_counter()
    finally:
        for ticket in tickets:
            engine.cancel(ticket)
        for t in trackers:
            t.done.wait(60)
    inside, outside = [], []
    in_tokens = 0
    for t in trackers:
        ts = [x for x in t.times if steady <= x <= end]
        in_tokens += sum(submitted < x <= first for x in ts)
        for a, b in zip(ts, ts[1:], strict=False):
            (inside if b > submitted and a < first else outside).append(b - a)
    window = first - submitted
    out_s = (end - steady) - window
    out_tokens = sum(sum(steady <= x <= end for x in t.times) for t in trackers) - in_tokens
    return {"ttft_ms": 1e3 * window, "in_median_ms": 1e3 * statistics.median(inside) if inside else float("nan"),
            "in_max_ms": 1e3 * max(inside, default=float("nan")), "out_median_ms": 1e3 * statistics.median(outside),
            "out_max_ms": 1e3 * max(outside), "in_gaps": len(inside), "in_tok_s": in_tokens / window,
            "out_tok_s": out_tokens / out_s}


def part_b(folder: Path, run_cfg: RunConfig, settings: list[int], long_len: int, reps: int,
           lead_s: float) -> dict[str, dict[str, float]]:
    tok = ChatTokenizer(folder)
    chats = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    long = text_prompt(folder, long_len)
    ctx = load_manifest(folder).arch.max_context
    engines = {c: Engine(LocalPipeline(folder, run_cfg), Limits(8, 8), ctx, SchedulerConfig(chunk=c, groups=1))
               for c in settings}
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in settings}
    try:
        for engine in engines.values():  # warm-up: the long prompt's chunk shapes, a group of 4
            stall_once(engine, chats, long, 0.2)
        for r in range(reps):
            for c in (settings if r % 2 == 0 else settings[::-1]):
                runs[c].append(x := stall_once(engines[c], chats, long, lead_s))
                print(f"  (b) rep {r + 1}/{reps} chunk {c}: TTFT {x['ttft_ms']:.0f} ms, gaps in window median "
                      f"{x['in_median_ms']:.0f} max {x['in_max_ms']:.0f}, outside median {x['out_median_ms']:.0f} "
                      f"max {x['out_max_ms']:.0f} ms", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
            engine.pipe.shutdown()
    return {str(c): {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in runs.items()}


def print_b(b: dict[str, dict[str, float]], long_len: int) -> None:
    print(f"\n(b) 4 streams decoding (one group) while a {long_len}-token prompt arrives; ms, medians over reps "
          "of each rep's figure")
    print(f"{'chunk':>7}{'TTFT':>8}{'gap in: median':>16}{'max':>8}{'gap out: median':>17}{'max':>8}"
          f"{'tok/s in':>10}{'tok/s out':>11}")
    for c, x in b.items():
        name = f"{c}" + (" (whole)" if int(c) >= long_len else "")
        print(f"{name:>7}{x['ttft_ms']:>8.0f}{x['in_median_ms']:>16.1f}{x['in_max_ms']:>8.0f}"
              f"{x['out_median_ms']:>17.1f}{x['out_max_ms']:>8.0f}{x['in_tok_s']:>10.1f}{x['out_tok_s']:>11.1f}")


# --- (d) the lm_head at every position vs the last only -------------------------------------------


def peak_mb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux keeps that across
    execve, so a spawned child starts with its parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def head_case(folder: str, length: int, chunk: int, every: bool, reps: int, threads: int) -> dict[str, float]:
    """In a fresh process: TTFT of a `length`-token prompt in `chunk`-token steps (median of reps)
    and the process's peak RSS, with the lm_head at every position or at the last only."""
    path = Path(folder)
    pipe = LocalPipeline(path, RunConfig(threads=threads))
    if every:
        all_positions_head(pipe.stages[-1])
    prompt = text_prompt(path, length)
    prefill_s(pipe, prompt[:8], 8)  # the stages' first calls
    loaded = peak_mb()
    times = [prefill_s(pipe, prompt, chunk) for _ in range(reps)]
    pipe.shutdown()
    return {"ttft_ms": 1e3 * statistics.median(times), "first_ms": 1e3 * times[0], "peak_mb": peak_mb(),
            "over_loaded_mb": peak_mb() - loaded}


def part_d(folder: Path, lengths: list[int], chunk: int, reps: int, rounds: int, threads: int) -> dict[str, Any]:
    spawn = get_context("spawn")
    got: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for n in lengths:
            for c in (n, chunk) if chunk < n else (n,):
                for every in ((True, False) if r % 2 == 0 else (False, True)):
                    name = f"{n}-{'whole' if c == n else c}-{'every' if every else 'last'}"
                    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                        x = pool.submit(head_case, str(folder), n, c, every, reps, threads).result()
                    got.setdefault(name, []).append(x)
                    print(f"  (d) round {r + 1}/{rounds} {name}: TTFT {x['ttft_ms']:.0f} ms, peak {x['peak_mb']:.0f} "
                          f"MB (+{x['over_loaded_mb']:.0f})", file=sys.stderr, flush=True)
    return {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in got.items()}


def print_d(d: dict[str, Any]) -> None:
    print("\n(d) lm_head at every prompt position (before) vs the last only (after): TTFT ms (prefill through "
          "both stages) and peak RSS MB of a fresh process (+ over the loaded pipeline)")
    print(f"{'prompt':>7}{'steps':>8}{'TTFT before':>13}{'after':>8}{'ratio':>7}{'peak before':>13}{'after':>8}"
          f"{'+before':>9}{'+after':>8}")
    for key in d:
        if not key.endswith("-every"):
            continue
        base = key.removesuffix("-every")
        b, a = d[key], d[f"{base}-last"]
        n, steps = base.split("-", 1)
        print(f"{n:>7}{steps:>8}{b['ttft_ms']:>13.0f}{a['ttft_ms']:>8.0f}{b['ttft_ms'] / a['ttft_ms']:>7.2f}"
              f"{b['peak_mb']:>13.0f}{a['peak_mb']:>8.0f}{b['over_loaded_mb']:>9.0f}{a['over_loaded_mb']:>8.0f}")


# --- driver ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c,d")
    p.add_argument("--quick", action="store_true", help="smoke run: few chunks and lengths, 1 rep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunks", default=",".join(map(str, CHUNKS)))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--pipelined-at", type=int, default=2048, help="(a): prompt length also run with every chunk "
                   "submitted at once (0: skip)")
    p.add_argument("--stall-chunks", default=f"4096,{DEFAULT_PREFILL_CHUNK},64",
                   help="(b): chunk settings (one >= the prompt: whole prefill)")
    p.add_argument("--stall-prompt", type=int, default=2048)
    p.add_argument("--stall-reps", type=int, default=5)
    p.add_argument("--lead", type=float, default=2.0, help="(b): seconds of steady decoding before and after")
    p.add_argument("--knee", type=float, default=0.10, help="(c): within this share of the best tok/s")
    p.add_argument("--head-lengths", default="128,512,2048")
    p.add_argument("--head-reps", type=int, default=5, help="(d): prefills per process")
    p.add_argument("--head-rounds", type=int, default=2, help="(d): fresh processes per case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    args = p.parse_args()
    todo = set(args.parts.split(","))
    chunks = [int(x) for x in args.chunks.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    stall = [int(x) for x in args.stall_chunks.split(",")]
    head_lengths = [int(x) for x in args.head_lengths.split(",")]
    reps, stall_reps, head_reps, rounds, stall_len = (args.reps, args.stall_reps, args.head_reps, args.head_rounds,
                                                      args.stall_prompt)
    if args.quick:
        chunks, lengths, reps, stall_reps, head_reps, rounds = [64, 256], [128, 512], 1, 1, 2, 1
        stall, stall_len, head_lengths, args.pipelined_at = [512, 64], 512, [128, 512], 512
    load = os.getloadavg()[0]
    folder = shard_folder(args.work, 2, balance=True)
    run_cfg = RunConfig(threads=args.threads)
    figures: dict[str, Any] = {}
    a = b = d = None
    if "a" in todo or "c" in todo:
        pipe = LocalPipeline(folder, run_cfg)
        try:
            a = part_a(pipe, folder, chunks, lengths, reps, args.pipelined_at if args.pipelined_at in lengths else None)
        finally:
            pipe.shutdown()
    if "b" in todo:
        b = part_b(folder, run_cfg, stall, stall_len, stall_reps, args.lead)
    if "d" in todo:
        d = part_d(folder, head_lengths, DEFAULT_PREFILL_CHUNK, head_reps, rounds, args.threads)

    print(f"\ndefault 2-stage gguf export in one process, exact precision, {args.threads} threads; load average "
          f"{load:.1f} at start")
    if a is not None:
        print_a(a, chunks, lengths)
        k = knee(a, chunks, lengths, args.knee)
        print(f"\n(c) knee: smallest chunk within {args.knee:.0%} of the best at lengths >= 1024: {k} "
              f"(the default now: {DEFAULT_PREFILL_CHUNK})")
        top = {n: max(a["tok_s"][f"{n}-{c}"] for c in chunks) for n in lengths}
        figures |= {f"ratio_chunk{c}_vs_best_len{n}": round(a["tok_s"][f"{n}-{c}"] / top[n], 3)
                    for n in lengths for c in chunks if c in (DEFAULT_PREFILL_CHUNK, k)}
        figures |= {"knee_chunk": k, "knee_within": args.knee}
    if b is not None:
        print_b(b, stall_len)
        whole = next((c for c in b if int(c) >= stall_len), None)
        for c in b:
            if whole is not None and c != whole:
                figures[f"ratio_stall_max_gap_whole_vs_chunk{c}"] = round(b[whole]["in_max_ms"] / b[c]["in_max_ms"], 2)
                figures[f"ratio_ttft_chunk{c}_vs_whole"] = round(b[c]["ttft_ms"] / b[whole]["ttft_ms"], 3)
    if d is not None:
        print_d(d)
        for key in d:
            if key.endswith("-every"):
                base = key.removesuffix("-every")
                figures[f"ratio_ttft_every_vs_last_{base}"] = round(d[key]["ttft_ms"] / d[f"{base}-last"]["ttft_ms"], 3)
                figures[f"peak_mb_every_minus_last_{base}"] = round(d[key]["peak_mb"] - d[f"{base}-last"]["peak_mb"], 1)
    figures |= {"default_chunk": DEFAULT_PREFILL_CHUNK, "threads": args.threads, "reps": reps,
                "load_avg_1m_at_start": round(load, 2)}
    if a is not None:
        figures["prefill_tok_s"] = {k: round(v, 1) for k, v in a["tok_s"].items()}
        figures["prefill_tok_s_all_chunks_at_once"] = {k: round(v, 1) for k, v in a["pipelined_tok_s"].items()}
    if b is not None:
        figures["stall"] = {c: {k: round(v, 2) for k, v in x.items()} for c, x in b.items()}
        figures["stall_prompt"], figures["stall_reps"] = stall_len, stall_reps
    if d is not None:
        figures["lm_head"] = {c: {k: round(v, 2) for k, v in x.items()} for c, x in d.items()}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
