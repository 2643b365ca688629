"""Peak memory of exporting each stage of a 1-, 3- and 5-stage split: it must scale with the stage, not the model.

Each split of the default model (SmolLM2-135M-Instruct) is exported with isolate=True: every stage
is built in its own spawned process, which records its peak RSS (`export_peak_rss_mb` in the
manifest). A spawned process that only imports what a stage worker imports gives the baseline,
so the table also shows each stage's increment over it, and over a second baseline that also
opens the model source (every worker does; for a GGUF that parses the whole tokenizer metadata).

    python bench/export_memory.py                   # fp32 weights
    python bench/export_memory.py --weights gguf
    python bench/export_memory.py --quick           # 1- and 3-stage splits only

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from shardline.config import WEIGHTS, ExportConfig

# What a stage worker imports before touching any tensor; NNCF only for the weights it compresses.
# (NNCF imports torch when it is installed, so that baseline is far larger.)
BASE_MODULES = ("openvino", "shardline.export.exporter", "shardline.model.gguf_source")
NNCF_MODULES = (*BASE_MODULES, "nncf")


@dataclass
class Row:
    stage: int
    layers: str  # "first-last", plus +emb / +head for the stages that own them
    peak_mb: float
    over_baseline_mb: float
    over_opened_mb: float  # over the baseline that also opened the model source
    file_mb: float  # xml + bin


def _imports_peak_mb(modules: tuple[str, ...], open_model: bool) -> float:
    """Run in a spawned process: import `modules` (and open the default model), return the peak RSS in MB."""
    for m in modules:
        importlib.import_module(m)
    if open_model:
        from shardline.model.source import open_source

        open_source(None)
    # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across execve, so a spawned child
    # would start from its parent's peak.
    with open("/proc/self/status") as f:
        return round(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024, 1)


def baseline_mb(modules: tuple[str, ...], open_model: bool = False, reps: int = 3) -> float:
    """Median peak RSS of fresh spawned processes that only import `modules` (spawned like the stage workers)."""
    ctx = get_context("spawn")
    peaks = []
    for _ in range(reps):
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
            peaks.append(pool.submit(_imports_peak_mb, modules, open_model).result())
    return statistics.median(peaks)


def export_split(work: Path, weights: str, stages: int, group_size: int, base: tuple[float, float],
                 keep: bool) -> list[Row]:
    """Export a fresh `stages`-stage split with isolate=True; one row per stage."""
    from shardline.export.exporter import export

    tmp = Path(tempfile.mkdtemp(prefix=f"export-memory-{weights}-{stages}stages-", dir=work))
    try:
        folder = export(ExportConfig(out=tmp / "shards", stages=stages, weights=weights, group_size=group_size,
                                     isolate=True, progress=False))
        manifest = json.loads((folder / "manifest.json").read_text())
        rows = []
        for s in manifest["stages"]:
            size = sum((folder / s[k]).stat().st_size for k in ("xml", "bin"))
            extra = "".join(t for t, has in ((" +emb", s["has_embedding"]), (" +head", s["has_head"])) if has)
            peak = float(s["export_peak_rss_mb"])
            rows.append(Row(s["index"], f"{s['first_layer']}-{s['last_layer']}{extra}", peak,
                            round(peak - base[0], 1), round(peak - base[1], 1), round(size / 2**20, 1)))
        if keep:
            print(f"kept {folder}", file=sys.stderr)
        return rows
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="fp32", choices=WEIGHTS)
    p.add_argument("--group-size", type=int, default=64, help="int4 only")
    p.add_argument("--splits", default="1,3,5", help="comma-separated stage counts (default 1,3,5)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench",
                   help="parent of the temporary export folders")
    p.add_argument("--keep", action="store_true", help="keep the exported folders")
    p.add_argument("--quick", action="store_true", help="smoke run: 1- and 3-stage splits only")
    args = p.parse_args()
    splits = [1, 3] if args.quick else [int(s) for s in args.splits.split(",")]
    if 1 not in splits:
        p.error("--splits must include 1 (the whole-model reference)")
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]

    print("measuring the import baselines ...", file=sys.stderr)
    base_plain = baseline_mb(BASE_MODULES)
    base_nncf = baseline_mb(NNCF_MODULES)
    mods = NNCF_MODULES if args.weights in ("int8", "int4") else BASE_MODULES
    base = base_nncf if args.weights in ("int8", "int4") else base_plain
    opened = baseline_mb(mods, open_model=True)
    results: dict[int, list[Row]] = {}
    for n in splits:
        print(f"exporting a {n}-stage split ({args.weights}) ...", file=sys.stderr)
        results[n] = export_split(args.work, args.weights, n, args.group_size, (base, opened), args.keep)

    print(f"\nexport peak RSS per stage, weights {args.weights}, isolate=True, load average {load:.1f} at start")
    print(f"baseline (spawned process, imports only): {base_plain:.1f} MB without NNCF, {base_nncf:.1f} MB with "
          f"NNCF; using {base:.1f} MB; {opened:.1f} MB once the model source is opened too")
    print(f"{'split':>5} {'stage':>5} {'layers':<16} {'peak MB':>9} {'over base MB':>13} {'over opened MB':>15} "
          f"{'file MB':>9}")
    for n, rows in results.items():
        for r in rows:
            print(f"{n:>5} {r.stage:>5} {r.layers:<16} {r.peak_mb:>9.1f} {r.over_baseline_mb:>13.1f} "
                  f"{r.over_opened_mb:>15.1f} {r.file_mb:>9.1f}")

    def top(n: int, key: str) -> float:
        return max(float(getattr(r, key)) for r in results[n])

    figures: dict[str, object] = {}
    for n in [s for s in splits if s != 1]:  # the largest stage of each split against the whole model
        figures[f"ratio_{n}stage_max_increment_vs_1stage"] = ratio(top(n, "over_baseline_mb"),
                                                                  top(1, "over_baseline_mb"))
        figures[f"ratio_{n}stage_max_increment_over_opened_vs_1stage"] = ratio(top(n, "over_opened_mb"),
                                                                              top(1, "over_opened_mb"))
        figures[f"ratio_{n}stage_max_peak_vs_1stage"] = ratio(top(n, "peak_mb"), top(1, "peak_mb"))
        figures[f"ratio_{n}stage_max_file_vs_1stage"] = ratio(top(n, "file_mb"), top(1, "file_mb"))
    figures |= {
        "weights": args.weights, "group_size": args.group_size if args.weights == "int4" else None,
        "baseline_mb": base, "baseline_no_nncf_mb": base_plain, "baseline_with_nncf_mb": base_nncf,
        "baseline_opened_source_mb": opened,
        "load_avg_1m_at_start": round(load, 2),
        "stages": {f"{n}stage": [asdict(r) for r in rows] for n, rows in results.items()},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
