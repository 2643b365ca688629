"""The paged runner against the stateful one (issue 41), each engine built by the composition
root (server.open_engine) as `shardline serve` builds it, every stage in this process, the
default model's 2-stage export (exact precision, greedy, stop tokens ignored):

- decode: aggregate decode tok/s with 1, 4 and 8 streams at once (each `--tokens` new tokens
  after a short chat prompt), median of `--reps` runs; paged / stateful.
- admission: `--conversations` conversations of 512 tokens (a 256-token prompt, 256 new) sent
  at once to engines given the same KV memory (`--kv-mib`): the stateful engine admits as many
  streams as that memory holds at the full context (server.stream_limits), the paged one as
  many as have blocks for their tokens now. The most streams decoding at once, and the time to
  serve them all; paged / stateful.

    python bench/paged.py --quick
    python bench/paged.py
    python bench/paged.py --workers 2     # stage 0 here, stages 1-2 on worker processes (loopback)

The last line on stdout is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kit import TEXT, Proc, shard_folder, wait_quiet, worker

from shardline.config import RunConfig, SamplingConfig, ServeConfig
from shardline.host import available_memory
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_engine
from shardline.serving.engine import Engine, Event, Request

MiB = 2**20


def run_streams(engine: Engine, prompts: list[list[int]], n: int, timeout_s: float = 1800) -> dict[str, float]:
    """Every prompt at once, `n` new tokens each: aggregate decode tok/s (tokens after each
    stream's first, from the first stream's first token to the last one's last), the most
    streams between their first and last token at once, and the wall time."""
    done = threading.Semaphore(0)
    stamps: list[list[float]] = [[] for _ in prompts]

    def collector(i: int) -> Callable[[Event], None]:
        def on(ev: Event) -> None:
            if ev.token is not None:
                stamps[i].append(time.perf_counter())
            if ev.finish:
                if ev.finish != "length":
                    print(f"stream {i}: {ev.finish} {ev.error}", file=sys.stderr)
                done.release()
        return on

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(Request(p, SamplingConfig(max_tokens=n), frozenset()), collector(i))
    for _ in prompts:
        if not done.acquire(timeout=timeout_s):
            raise RuntimeError(f"a stream did not finish within {timeout_s} s")
    wall = time.perf_counter() - start
    spans = [(s[0], s[-1]) for s in stamps if s]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = live = 0
    for _, d in events:
        live += d
        most = max(most, live)
    first, last = min(a for a, _ in spans), max(b for _, b in spans)
    return {"tok_s": sum(len(s) - 1 for s in stamps) / (last - first), "most_at_once": most, "wall_s": wall}


def engine_for(folder: Path, kv_mib: int | None, max_streams: int | None, workers: list[str]) -> Engine:
    """`serve`'s engine (over `workers` if any); with `kv_mib`, its KV memory that many MiB and
    its streams as many as fit."""
    cfg = ServeConfig(max_streams=max_streams, max_queue=1024, prefix_cache_mb=0)
    if kv_mib is not None:  # the stateful engine's streams within that memory; the paged one's pool of it
        cfg = replace(cfg, memory_fraction=min(1.0, (kv_mib + 1) * MiB / available_memory()), kv_cache_mb=kv_mib)
    engine, _ = open_engine(folder, RunConfig(), cfg, workers or None)
    assert isinstance(engine, Engine)
    return engine


class Workers:
    """Stages 1..W of `folder` on worker processes (loopback) for the run of a `with` block."""

    def __init__(self, folder: Path, n: int) -> None:
        self.procs: list[Proc] = [worker(folder, k) for k in range(1, n + 1)]

    def __enter__(self) -> list[str]:
        return [p.addr for p in self.procs]

    def __exit__(self, *_: object) -> None:
        for p in self.procs:
            p.stop()


def decode(folders: dict[str, Path], prompt: list[int], n: int, reps: int, workers: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for name, folder in folders.items():
        with Workers(folder, workers) as addrs:
            out[name] = _decode(engine_for(folder, None, 8, addrs), prompt, n, reps)
        print(f"decode {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def _decode(engine: Engine, prompt: list[int], n: int, reps: int) -> dict[int, float]:
    try:
        run_streams(engine, [prompt], 4)  # warm-up
        return {k: statistics.median(run_streams(engine, [prompt] * k, n)["tok_s"] for _ in range(reps))
                for k in (1, 4, 8)}
    finally:
        engine.shutdown()


def admission(folders: dict[str, Path], prompts: list[list[int]], kv_mib: int,
              workers: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, folder in folders.items():
        with Workers(folder, workers) as addrs:
            engine = engine_for(folder, kv_mib, None, addrs)
            try:
                out[name] = run_streams(engine, prompts, 256) | {"limit": engine.limits.max_streams}
            finally:
                engine.shutdown()
        print(f"admission {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer tokens and conversations, one rep")
    p.add_argument("--parts", default="decode,admission")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--kv-mib", type=int, default=1536, help="the KV memory both engines get in the admission part")
    p.add_argument("--workers", type=int, default=0, help="stages 1..W on worker processes (default: all here)")
    p.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    args = p.parse_args()
    if args.quick:
        args.tokens, args.reps, args.conversations = 16, 1, 8
    quiet, load = wait_quiet()
    stages = 1 + max(1, args.workers)
    folders = {"stateful": shard_folder(args.work, stages, balance=True),
               "paged": shard_folder(args.work, stages, balance=True, paged=True)}
    tok = ChatTokenizer(folders["stateful"])
    prompt = tok.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    text = tok.encode(TEXT)
    convs = [[1000 + i] + (text * 2)[i : i + 255] for i in range(args.conversations)]  # 256 tokens, each its own
    parts = args.parts.split(",")
    dec = decode(folders, prompt, args.tokens, args.reps, args.workers) if "decode" in parts else {}
    adm = admission(folders, convs, args.kv_mib, args.workers) if "admission" in parts else {}
    where = f"stage 0 here, {args.workers} workers" if args.workers else "every stage in this process"
    print(f"\nload {load:.2f} at start ({'quiet' if quiet else 'NOT quiet'}); medians of {args.reps} runs; {where}")
    ratios: dict[str, float] = {}
    figures: dict[str, float] = {}
    if dec:
        print(f"{'decode tok/s':<16}" + "".join(f"{f'{k} streams':>12}" for k in (1, 4, 8)))
        for name in folders:
            print(f"{name:<16}" + "".join(f"{dec[name][k]:>12.1f}" for k in (1, 4, 8)))
        ratios |= {f"ratio_decode_{k}_paged_vs_stateful": round(dec["paged"][k] / dec["stateful"][k], 3)
                   for k in (1, 4, 8)}
        figures |= {f"{n}_decode_{k}_tok_s": round(dec[n][k], 1) for n in folders for k in (1, 4, 8)}
    if adm:
        print(f"\n{f'admission ({args.conversations} x 512 tokens, {args.kv_mib} MiB KV)':<48}"
              f"{'limit':>8}{'at once':>9}{'wall s':>9}{'tok/s':>8}")
        for name in folders:
            a = adm[name]
            print(f"{name:<48}{a['limit']:>8}{a['most_at_once']:>9}{a['wall_s']:>9.1f}{a['tok_s']:>8.1f}")
        ratios["ratio_admitted_at_once_paged_vs_stateful"] = round(
            adm["paged"]["most_at_once"] / adm["stateful"]["most_at_once"], 2)
        ratios["ratio_wall_paged_vs_stateful"] = round(adm["paged"]["wall_s"] / adm["stateful"]["wall_s"], 3)
        figures |= {f"{n}_admission_{key}": round(v, 2) for n in folders for key, v in adm[n].items()}
    print(json.dumps(ratios | figures | {"reps": args.reps, "workers": args.workers, "quiet": quiet,
                                         "load_at_start": round(load, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
