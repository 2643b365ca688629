"""KV transfer's two ends in process (issue 13, point 7): how long does exporting a stream's KV
from every stage take, and importing it into a fresh key, against its bytes? The figures the
disaggregation simulator's transfer cost starts from (before any wire).

The default model's 2-stage export (cached, `shardline.export.defaults`), a LocalPipeline with
the serving run config. For each prompt length: one stream prefilled with that many tokens,
then --reps exports (`export_kv`, every stage's state copied, through the stage threads) and
imports of the snapshot into a fresh key (`import_kv`, checked, then opened and written on
every stage), each timed from the call to its Future's result. Medians.

    python bench/kv_transfer.py --quick
    python bench/kv_transfer.py

The last line on stdout is one JSON object with the figures, throughputs (GB/s) first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from kit import wait_quiet  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig, SamplingParams
from shardline.export.defaults import default_shards
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import export_kv, import_kv, prefill, run
from shardline.stage.cache import KVBook

CHUNK = 512  # prompt tokens per prefill step, as serving would chunk a long prompt
IMPORTED = 1  # the key every import goes to (released before the next)
WAIT_S = 600.0


def _prefilled(pipe: LocalPipeline, key: int, n: int) -> None:
    """A stream of n random tokens under `key` on every stage."""
    ids = np.random.default_rng(n).integers(100, 20000, n).tolist()
    book = KVBook()
    for start in range(0, n, CHUNK):
        step = prefill(key, book, ids[start:start + CHUNK], SamplingParams(), first=start == 0,
                       last=start + CHUNK >= n)
        (out,) = run(pipe, step)
        if out.failed:
            raise SystemExit(f"prefill of {n} tokens failed: {out.error}")


def measure(pipe: LocalPipeline, n: int, reps: int) -> dict[str, float]:
    """Median export and import times of a stream of n tokens, and its KV bytes."""
    key = 1000 + n
    _prefilled(pipe, key, n)
    export_s, import_s, nbytes = [], [], 0
    for _ in range(reps):
        start = time.perf_counter()
        snap = export_kv(pipe, key).result(WAIT_S)
        export_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        import_kv(pipe, IMPORTED, snap).result(WAIT_S)
        import_s.append(time.perf_counter() - start)
        pipe.release(IMPORTED)  # queued ahead of the next import: the key is free again by then
        nbytes = snap.nbytes
    pipe.release(key)
    ex, im = statistics.median(export_s), statistics.median(import_s)
    return {"export_gbps": nbytes / ex / 1e9, "import_gbps": nbytes / im / 1e9, "export_ms": 1e3 * ex,
            "import_ms": 1e3 * im, "kv_mb": nbytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,256,1024,4096")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine")
    ap.add_argument("--quick", action="store_true", help="64 and 256 tokens, 3 reps, no wait")
    args = ap.parse_args()
    lengths = [64, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    reps = 3 if args.quick else args.reps
    quiet, load = wait_quiet(max_wait_s=0 if args.quick else args.max_wait)
    with LocalPipeline(default_shards(progress=False), RunConfig()) as pipe:
        rows = {n: measure(pipe, n, reps) for n in lengths}
    print(f"{'tokens':>6} {'KV MB':>8} {'export ms':>10} {'import ms':>10} {'export GB/s':>12} {'import GB/s':>12}")
    for n, r in rows.items():
        print(f"{n:>6} {r['kv_mb']:>8.2f} {r['export_ms']:>10.2f} {r['import_ms']:>10.2f} "
              f"{r['export_gbps']:>12.2f} {r['import_gbps']:>12.2f}")
    print(f"medians of {reps}; {'quiet' if quiet else 'NOT quiet'} machine (load {load:.2f})")
    figures = {f"{k}_{n}": round(r[k], 3) for k in ("export_gbps", "import_gbps") for n, r in rows.items()}
    figures |= {f"{k}_{n}": round(v, 3) for n, r in rows.items() for k, v in r.items() if not k.endswith("gbps")}
    print(json.dumps(figures | {"reps": reps, "quiet": quiet, "load": round(load, 2)}))


if __name__ == "__main__":
    main()
