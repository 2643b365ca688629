"""The cost of compacting a stream's KV cache (issue 10): speculation masks rejected drafts out of
every stage's cache, and once `compact_at` slots are masked a step compacts it (each stage reads
its state, drops the masked slots, writes it back). How long does that take, next to the decode
step it rides on, and what does a decode step over a cache full of masked slots cost instead?

The default model's 2-stage gguf export, every stage in this process (StageRunner directly, no
threads), exact precision. For each cache length S: one stream prefilled with S tokens, then a
quarter of its slots masked at random; per stage, the time of `compact` (the whole copy) and of
one decode step before and after compaction. Medians of --reps.

    python bench/compaction.py --quick
    python bench/compaction.py

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from kit import shard_folder  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig
from shardline.model.manifest import load_manifest
from shardline.stage.cache import StepInputs, compaction
from shardline.stage.runner import StageRunner


def _prefilled(stages: list[StageRunner], key: int, n: int) -> np.ndarray:
    """A stream of n tokens on every stage; returns its mask (all ones)."""
    ids = np.random.default_rng(0).integers(100, 20000, (1, n), dtype=np.int64)
    mask = np.ones((1, n), np.int64)
    out = None
    for st in stages:
        st.close(key)
        st.open(key)
        out = st.run(key, StepInputs(ids, mask, np.arange(n, dtype=np.int64)[None]), out)
    return mask


def _decode_s(stages: list[StageRunner], key: int, mask: np.ndarray, position: int) -> float:
    inputs = StepInputs(np.array([[42]], np.int64), np.concatenate([mask, [[1]]], axis=1),
                        np.array([[position]], np.int64))
    start, out = time.perf_counter(), None
    for st in stages:
        out = st.run(key, inputs, out)
    return time.perf_counter() - start


def measure(stages: list[StageRunner], n: int, reps: int) -> dict[str, float]:
    compact_s, before_s, after_s = [], [], []
    rng = np.random.default_rng(n)
    for rep in range(reps):
        mask = _prefilled(stages, rep, n)
        mask[0, rng.choice(n - 1, n // 4, replace=False)] = 0  # a quarter masked (never the last)
        live = int(mask.sum())
        before_s.append(_decode_s(stages, rep, mask, live))
        mask = np.concatenate([mask, [[1]]], axis=1)  # the decode step's own slot
        index, after = compaction(mask)
        start = time.perf_counter()
        for st in stages:
            st.compact(rep, index, mask.shape[1])
        compact_s.append(time.perf_counter() - start)
        after_s.append(_decode_s(stages, rep, after, live + 1))
        for st in stages:
            st.close(rep)
    return {"compact_ms": 1e3 * statistics.median(compact_s), "decode_before_ms": 1e3 * statistics.median(before_s),
            "decode_after_ms": 1e3 * statistics.median(after_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="256 and 1024 slots, 3 reps")
    args = ap.parse_args()
    lengths = [256, 1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    reps = 3 if args.quick else args.reps
    folder = shard_folder(args.work, 2, balance=True)
    manifest = load_manifest(folder)
    stages = [StageRunner(folder, e, RunConfig(), vocab=manifest.arch.vocab) for e in manifest.stages]
    rows = {n: measure(stages, n, reps) for n in lengths}
    print(f"{'slots':>6} {'compact ms':>11} {'decode ms (25% masked)':>23} {'decode ms (compacted)':>22} "
          f"{'compact / decode':>17}")
    for n, r in rows.items():
        print(f"{n:>6} {r['compact_ms']:>11.2f} {r['decode_before_ms']:>23.2f} {r['decode_after_ms']:>22.2f} "
              f"{r['compact_ms'] / r['decode_after_ms']:>17.2f}")
    figures = {f"compact_over_decode_{n}": round(r["compact_ms"] / r["decode_after_ms"], 3) for n, r in rows.items()}
    figures |= {f"{k}_{n}": round(v, 3) for n, r in rows.items() for k, v in r.items()}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
