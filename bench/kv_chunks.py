"""Chunk-level against request-level KV transfer (issue 13, point 7): how long a prefilled stream
waits, after its first token, until its KV is on the decode instance; what exporting chunk by
chunk costs the prefill; in process and over worker links (TLS, loopback).

A stream of N random tokens is prefilled on instance A in chunks of 128 (serving's default),
as a prefill instance runs it: one chunk in flight at a time. Request-level: once the last
chunk's outcome is back (the first token), the whole cache is exported from A and imported into
B. Chunk-level: after each chunk's outcome the slots it added are exported (queued before the
next chunk, as disagg/prefill.py does); after the last, only its slots are left to export; the
slices are joined and imported into B. Timed per run: the prefill (start to first token) and the
wait after it (first token to the KV landed on B). Modes interleave, rep by rep; medians.

- `local`: A and B are two LocalPipelines of the default 2-stage export in this process.
- `workers`: A and B are RemotePipelines, stage 0 here and stage 1 on a worker process each
  (mutual TLS over loopback), so each slice travels a link to the coordinator and the whole
  cache another to B's worker.

    python bench/kv_chunks.py --quick
    python bench/kv_chunks.py

The last line on stdout is one JSON object with the figures, ratios (chunk / request) first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from kit import Proc, wait_quiet  # bench/ is on sys.path when this script runs

from shardline.cluster.keygen import keygen
from shardline.config import RunConfig, SamplingParams
from shardline.export.defaults import default_shards
from shardline.pipeline.kv import KvSnapshot, join
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Pipeline, export_kv, import_kv, prefill
from shardline.pipeline.remote import RemotePipeline
from shardline.stage.cache import KVBook
from shardline.wire.tls import Credentials

CHUNK = 128  # serving's default prefill chunk (config.DEFAULT_PREFILL_CHUNK)
WAIT_S = 600.0
MODES = ("request", "chunk")


def _outcome(pipe: Pipeline) -> None:
    while not (outs := pipe.outcomes(WAIT_S)):
        pass
    if outs[0].failed:
        raise SystemExit(f"a prefill chunk failed: {outs[0].error}")


def once(a: Pipeline, b: Pipeline, n: int, mode: str, key: int) -> tuple[float, float, int]:
    """One stream of n tokens prefilled on `a` and moved to `b` as `mode` says: (prefill s, wait
    after the first token s, KV bytes)."""
    ids = np.random.default_rng(n).integers(100, 20000, n).tolist()
    book, slices, through = KVBook(), list[object](), 0
    start = time.perf_counter()
    for at in range(0, n, CHUNK):
        a.submit(prefill(key, book, ids[at:at + CHUNK], SamplingParams(), first=at == 0, last=at + CHUNK >= n))
        _outcome(a)
        if mode == "chunk" and at + CHUNK < n:
            slices.append(export_kv(a, key, through))
            through = book.slots
    first = time.perf_counter()
    slices.append(export_kv(a, key, through))
    kv: KvSnapshot = join([f.result(WAIT_S) for f in slices])  # type: ignore[attr-defined]
    import_kv(b, key, kv).result(WAIT_S)
    landed = time.perf_counter()
    a.release(key)
    b.release(key)
    return first - start, landed - first, kv.nbytes


@contextmanager
def instances(where: str, folder: Path, run: RunConfig) -> Iterator[tuple[Pipeline, Pipeline]]:
    if where == "local":
        with LocalPipeline(folder, run) as a, LocalPipeline(folder, run) as b:
            yield a, b
        return
    with tempfile.TemporaryDirectory(prefix="kv-chunks-") as tmp:
        creds = Path(tmp) / "cluster"
        keygen(creds, 3)
        workers = [Proc(["worker", "--shards", str(folder), "--stage", "1", "--listen", "127.0.0.1:0",
                         "--credentials", str(creds / f"node-{i}")], "listening on ") for i in (1, 2)]
        try:
            mine = Credentials.load(creds / "node-0")
            a, b = (RemotePipeline(folder, [w.addr], run, "f32", credentials=mine) for w in workers)
            try:
                yield a, b
            finally:
                a.shutdown()
                b.shutdown()
        finally:
            for w in workers:
                w.stop()


def measure(where: str, lengths: list[int], reps: int, folder: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with instances(where, folder, RunConfig()) as (a, b):
        once(a, b, 256, "chunk", 1)  # warm-up: compiled shapes, first links' buffers
        for n in lengths:
            runs: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
            for r in range(reps):
                for mode in MODES if r % 2 == 0 else reversed(MODES):
                    runs[mode].append(once(a, b, n, mode, 2))
            for mode, got in runs.items():
                out[f"{where} {n} {mode}"] = {"prefill_ms": 1e3 * statistics.median(x[0] for x in got),
                                              "after_ms": 1e3 * statistics.median(x[1] for x in got),
                                              "kv_mb": got[0][2] / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--where", default="local,workers")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine")
    ap.add_argument("--quick", action="store_true", help="256 tokens, 1 rep, no wait")
    args = ap.parse_args()
    lengths = [256] if args.quick else [int(x) for x in args.lengths.split(",")]
    reps = 1 if args.quick else args.reps
    quiet, load = wait_quiet(max_wait_s=0 if args.quick else args.max_wait)
    folder = default_shards(progress=False)
    rows: dict[str, dict[str, float]] = {}
    for where in args.where.split(","):
        rows |= measure(where, lengths, reps, folder)
    print(f"{'where':>8} {'tokens':>6} {'mode':>8} {'KV MB':>7} {'prefill ms':>11} {'after ms':>9}")
    for name, r in rows.items():
        where, n, mode = name.split()
        print(f"{where:>8} {n:>6} {mode:>8} {r['kv_mb']:>7.1f} {r['prefill_ms']:>11.1f} {r['after_ms']:>9.1f}")
    ratios = {}
    for name, r in rows.items():
        where, n, mode = name.split()
        if mode == "chunk":
            req = rows[f"{where} {n} request"]
            ratios[f"after_chunk_vs_request_{where}_{n}"] = round(r["after_ms"] / req["after_ms"], 3)
            ratios[f"prefill_chunk_vs_request_{where}_{n}"] = round(r["prefill_ms"] / req["prefill_ms"], 3)
    print(f"medians of {reps}; chunks of {CHUNK}; {'quiet' if quiet else 'NOT quiet'} machine (load {load:.2f})")
    figures = {name.replace(" ", "_"): {k: round(v, 2) for k, v in r.items()} for name, r in rows.items()}
    print(json.dumps(ratios | {"figures": figures, "reps": reps, "quiet": quiet, "load": round(load, 2)}))


if __name__ == "__main__":
    main()
