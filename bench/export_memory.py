"""Peak RSS per export process and per serving worker, against the stage's shard (issue 22 point 2).

For each `--weights` choice the model is exported in `--stages` stages, each stage in its own
process (the manifest records each one's peak RSS and its RSS before it read a weight); then
every stage but 0 is served by a `shardline worker` (stage 0 by a coordinator in this process)
through a few greedy requests, and each worker's peak RSS (VmHWM) is read before it stops.
Targets: an export process within its shard plus a bounded working set, a worker within its
shard plus its KV and a bounded runtime.

    python bench/export_memory.py                                  # the default model, gguf and int8
    python bench/export_memory.py --model my.gguf --weights gguf --stages 4

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from kit import Proc, open_serving, peak_rss_mb  # bench/ is on sys.path when this script runs

from shardline.config import ExportConfig, RunConfig, SamplingConfig, ServeConfig
from shardline.export.exporter import export
from shardline.model.manifest import load_manifest
from shardline.serving.generate import tokens


def serve_workers(folder: Path, context: int, requests: int) -> list[float]:
    """Each worker's peak RSS (MB) after `requests` greedy requests through the chain."""
    n = len(load_manifest(folder).stages)
    procs = []
    try:
        for i in range(1, n):
            procs.append(Proc(["worker", "--shards", str(folder), "--stage", str(i), "--insecure", "--context",
                               str(context)], "listening on ", timeout_s=1800))
        addrs = [p.addr for p in procs]
        engine, _ = open_serving(folder, RunConfig(context=context), ServeConfig(max_streams=1, max_queue=0), addrs,
                                 activations="f32")
        try:
            for r in range(requests):
                tokens(engine, [100 + r + i for i in range(64)], SamplingConfig(max_tokens=32))
        finally:
            engine.shutdown()
        return [peak_rss_mb(p.proc.pid) for p in procs]
    finally:
        for p in procs:
            p.stop()


def measure(model: Path | None, weights: str, args: argparse.Namespace) -> dict[str, Any]:
    out = args.work / f"{(model.stem if model else 'default')}-{weights}-{args.stages}"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export(ExportConfig(out=out, model=model, stages=args.stages, weights=weights, isolate=True, progress=False))
    m = load_manifest(out)
    shard = [(out / s.bin).stat().st_size / 2**20 for s in m.stages]
    rss = [s.export_peak_rss_mb or 0.0 for s in m.stages]
    base = [s.export_base_rss_mb or 0.0 for s in m.stages]
    workers = serve_workers(out, args.context, args.requests)
    return {"weights": weights, "shard_mb": shard, "export_rss_mb": rss, "export_base_mb": base,
            "worker_rss_mb": workers,
            "export_rss_over_shard": max(r / s for r, s in zip(rss, shard, strict=True)),
            "export_growth_over_shard": max((r - b) / s for r, b, s in zip(rss, base, shard, strict=True)),
            "worker_rss_over_shard": max(w / s for w, s in zip(workers, shard[1:], strict=True)),
            "worker_rss_minus_shard_mb": max(w - s for w, s in zip(workers, shard[1:], strict=True))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a GGUF file or Hugging Face folder (default: the default model)")
    p.add_argument("--weights", default="gguf,int8")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-export-memory")
    args = p.parse_args()
    if args.stages < 2:
        p.error("--stages must be at least 2 (stage 0 runs on the coordinator, the rest on workers)")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [measure(args.model, w, args) for w in args.weights.split(",")]
    print(f"{'weights':<8}{'shard MB':>22}{'export RSS MB':>24}{'growth/shard':>14}{'worker RSS MB':>22}"
          f"{'worker-shard MB':>17}")
    for r in rows:
        print(f"{r['weights']:<8}{', '.join(f'{x:.0f}' for x in r['shard_mb']):>22}"
              f"{', '.join(f'{x:.0f}' for x in r['export_rss_mb']):>24}{r['export_growth_over_shard']:>14.2f}"
              f"{', '.join(f'{x:.0f}' for x in r['worker_rss_mb']):>22}{r['worker_rss_minus_shard_mb']:>17.0f}")
    figures = {k: {r["weights"]: r[k] for r in rows} for k in (
        "export_rss_over_shard", "export_growth_over_shard", "worker_rss_over_shard", "worker_rss_minus_shard_mb",
        "shard_mb", "export_rss_mb", "export_base_mb", "worker_rss_mb")}
    print(json.dumps(figures | {"model": str(args.model or "default"), "stages": args.stages,
                                "context": args.context}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
