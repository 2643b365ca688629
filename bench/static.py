"""Static stages (issue 25) against stateful ones on this CPU: decode speed and time to first
token at 1 and 2 stages, side by side, and what the host KV ring costs per token.

A static stage (export --static) runs graphs of fixed shapes with its KV on the host: every
decode step reads the whole ring (masked past the cache), where a stateful stage reads only
the cache it holds. So the static step costs about the same at any context, and its cost over
the stateful one's at a short context is the ring's: the bytes of every layer's keys and
values over `--ring` slots, read once per token. That is set against the physical bound, the
ring's bytes over this machine's memory read rate (measured here: a BLAS dot product over a
vector far larger than the caches, which reads it once; a numpy copy's rate, reads and writes
counted, is printed beside it).

Each system serves one request at a time through the engine (server.py's composition root,
one stream, no decode groups; stop tokens ignored), in rounds that interleave the systems so
noise hits them alike; medians over rounds.

    python bench/static.py --quick
    python bench/static.py

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kit import open_serving, shard_folder, text_ids, wait_quiet  # bench/ is on sys.path when this runs

from shardline.config import ExportConfig, RunConfig, SamplingConfig, ServeConfig
from shardline.export.exporter import export
from shardline.model.manifest import EXPORT_TAG, load_manifest
from shardline.serving.engine import Engine, Event, Request


def static_folder(work: Path, stages: int, ring: int, chunk: int) -> Path:
    folder = work / f"smollm2-135m-gguf-{stages}stages-static{ring}-c{chunk}-{EXPORT_TAG}"
    if not (folder / "manifest.json").is_file():
        print(f"exporting {folder} ...", file=sys.stderr)
        work.mkdir(parents=True, exist_ok=True)
        export(ExportConfig(out=folder, stages=stages, weights="gguf", static=frozenset(range(stages)),
                            context=ring, prefill_chunk=chunk, isolate=False, progress=False))
    return folder


def one_request(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s after it) of one greedy request."""
    times: list[float] = []
    done = threading.Event()

    def on(ev: Event) -> None:
        if ev.token is not None:
            times.append(time.perf_counter())
        if ev.finish:
            done.set()

    start = time.perf_counter()
    engine.submit(Request(prompt, SamplingConfig(max_tokens=tokens), frozenset()), on)
    if not done.wait(600):
        raise RuntimeError("no answer within 600 s")
    return times[0] - start, (len(times) - 1) / (times[-1] - times[0])


def ring_bytes(folder: Path, ring: int) -> int:
    m = load_manifest(folder)
    return 2 * m.arch.n_layers * m.arch.n_kv_heads * m.arch.head_dim * ring * 4  # keys and values, f32


def copy_gbps() -> float:
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best / 1e9  # read + write


def read_gbps() -> float:
    a = np.ones(32 << 20, np.float32)  # 128 MiB: no cache holds it
    best = min(_timed(lambda: np.dot(a, a)) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 1 round")
    p.add_argument("--ring", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64, help="the static prefill graph's width (and every prompt chunk)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    args = p.parse_args()
    tokens, rounds = (16, 1) if args.quick else (args.tokens, args.rounds)
    quiet, load = wait_quiet()
    folders = {f"stateful-{n}": shard_folder(args.work, n) for n in (1, 2)}
    folders |= {f"static-{n}": static_folder(args.work, n, args.ring, args.chunk) for n in (1, 2)}
    prompt = text_ids(folders["stateful-1"], args.prompt)
    serve = ServeConfig(decode_groups=0, prefill_chunk=args.chunk, pacing=None, max_streams=1)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in folders}
    for r in range(rounds):
        for name, folder in folders.items():
            engine, _ = open_serving(folder, RunConfig(precision="exact"), serve)
            assert isinstance(engine, Engine)
            try:
                one_request(engine, prompt[:8], 4)  # warm: graphs compiled, first requests made
                got[name].append(one_request(engine, prompt, tokens))
            finally:
                engine.shutdown()
            print(f"  round {r + 1}: {name}: ttft {got[name][-1][0] * 1e3:.0f} ms, {got[name][-1][1]:.1f} tok/s",
                  file=sys.stderr)
    med = {name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for name, v in got.items()}
    gbps, reads, nbytes = copy_gbps(), read_gbps(), ring_bytes(folders["static-1"], args.ring)
    bound_ms = nbytes / (reads * 1e9) * 1e3  # the ring read once per token
    print(f"\nload {load:.2f} at start ({'quiet' if quiet else 'NOT quiet'}); prompt {len(prompt)} tokens, "
          f"{tokens} generated, ring {args.ring}, prefill chunk {args.chunk}; medians of {rounds} rounds")
    print(f"{'system':>12} {'ttft ms':>9} {'tok/s':>7} {'ms/token':>9}")
    for name, (ttft, rate) in med.items():
        print(f"{name:>12} {ttft * 1e3:9.0f} {rate:7.1f} {1e3 / rate:9.2f}")
    figures: dict[str, object] = {}
    for n in (1, 2):
        st, sf = med[f"static-{n}"], med[f"stateful-{n}"]
        figures[f"ratio_static_vs_stateful_tok_s_{n}stage"] = round(st[1] / sf[1], 3)
        figures[f"ratio_static_vs_stateful_ttft_{n}stage"] = round(st[0] / sf[0], 3)
    extra_ms = 1e3 / med["static-1"][1] - 1e3 / med["stateful-1"][1]
    print(f"ring: {nbytes / 2**20:.1f} MiB of keys and values per stage set, read every token; read rate "
          f"{reads:.1f} GB/s (copy {gbps:.1f}): bound {bound_ms:.2f} ms/token; "
          f"static - stateful at 1 stage: {extra_ms:.2f} ms/token")
    figures |= {"ring_mib": round(nbytes / 2**20, 2), "read_gbps": round(reads, 2), "copy_gbps": round(gbps, 2),
                "ring_bound_ms": round(bound_ms, 3),
                "static_minus_stateful_ms_per_token_1stage": round(extra_ms, 3), "load_at_start": round(load, 2),
                "quiet": quiet, "rounds": rounds, "tokens": tokens, "prompt": len(prompt), "ring": args.ring,
                "chunk": args.chunk,
                "medians": {k: {"ttft_ms": round(v[0] * 1e3, 1), "tok_s": round(v[1], 2)} for k, v in med.items()}}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
