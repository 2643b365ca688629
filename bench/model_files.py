"""Model files as people download them, per GGUF weight type: what `--weights gguf` keeps.

For each type, a 1B-class random file (TinyLlama-1.1B's shapes: 22 layers, hidden 2048, FFN
5632, 32/4 heads, vocabulary 32000; random blocks, which is fine where only size and speed
matter) is exported and measured:

- shard bytes against the file's tensor bytes (target <= 1.1x);
- export peak RSS of each stage process (2 stages, one process each) against that stage's
  shard size (target <= 1.25x), and what the process grew by from before it read a weight
  (~60 MB of interpreter, numpy and OpenVINO, fixed whatever the stage); the 1-stage export's too;
- decode tok/s of a 1-stage export (exact and fast precision), against llama.cpp's own
  llama-bench on the same file, default settings (its repacked kernels), same thread count.

    python bench/model_files.py                      # every type; needs bench/llama_cpp_tools.sh
    python bench/model_files.py --types Q4_K,Q6_K --quick

Repetitions alternate the systems; medians are reported. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ggufs.py builds the files

from steps import decode_tok_s  # noqa: E402  (bench/ is on sys.path when this script runs)

from shardline.config import ExportConfig, RunConfig, SamplingParams  # noqa: E402
from shardline.export.exporter import export  # noqa: E402
from shardline.model.manifest import load_manifest  # noqa: E402
from shardline.pipeline.local import LocalPipeline  # noqa: E402
from shardline.pipeline.plan import prefill, run  # noqa: E402
from shardline.stage.cache import KVBook  # noqa: E402
from tests.gguf_vocab import NORMAL, Vocab, byte_level_vocab  # noqa: E402
from tests.ggufs import ALL_TYPES, FileSpec, write  # noqa: E402

GREEDY = SamplingParams()
TOOLS = Path(__file__).with_name("llama_cpp_tools.sh")


def vocab(size: int) -> Vocab:
    """The tests' byte-level vocabulary, padded with unreachable tokens to `size`."""
    v = byte_level_vocab()
    extra = size - v.size
    return Vocab(model=v.model, pre=v.pre, tokens=v.tokens + [f"<pad{i}>" for i in range(extra)],
                 types=v.types + [NORMAL] * extra, merges=v.merges, bos=v.bos, eos=v.eos)


def spec(kind: str, quick: bool) -> FileSpec:
    if quick:
        return FileSpec(name=f"bench-{kind}", weights=kind, layers=4, hidden=1024, heads=16, kv_heads=4, ffn=2816,
                        vocab=vocab(32000))
    return FileSpec(name=f"bench-{kind}", weights=kind, layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632,
                    vocab=vocab(32000))


def tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def exported(model: Path, stages: int, work: Path) -> Path:
    out = work / f"{model.stem}-{stages}stage"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export(ExportConfig(out=out, model=model, stages=stages, isolate=True, progress=False))
    return out


def shardline_tok_s(folder: Path, precision: str, tokens: int, threads: int) -> float:
    with LocalPipeline(folder, RunConfig(precision=precision, threads=threads)) as pipe:
        book, key = KVBook(), 1
        prompt = list(range(100, 116))
        run(pipe, prefill(key, book, prompt, GREEDY, first=True, last=True))
        tok_s = decode_tok_s(pipe, key, book, 200, tokens, warmup=4)
        pipe.release(key)
    return tok_s


def llama_bench_tok_s(bin_dir: Path, model: Path, tokens: int, threads: int) -> float:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(tokens), "-t", str(threads),
           "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    (row,) = json.loads(out)
    return float(row["avg_ts"])


def measure(kind: str, args: argparse.Namespace, bin_dir: Path | None) -> dict[str, Any]:
    work = args.work / kind
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"bench-{kind}.gguf"
    if not model.exists():
        write(spec(kind, args.quick), model.with_suffix(".partial"), rng=np.random.default_rng(0))
        model.with_suffix(".partial").rename(model)
    file_bytes = tensor_bytes(model)
    one, two = exported(model, 1, work), exported(model, 2, work)
    row: dict[str, Any] = {"type": kind, "file_mb": file_bytes / 2**20,
                           "shard_over_file": (one / "stage0.bin").stat().st_size / file_bytes}
    m = load_manifest(two)
    rss = [s.export_peak_rss_mb or 0.0 for s in m.stages]
    base = [s.export_base_rss_mb or 0.0 for s in m.stages]
    shard = [(two / s.bin).stat().st_size / 2**20 for s in m.stages]
    row["stage_shard_mb"] = shard
    row["stage_export_rss_mb"] = rss
    row["stage_export_base_mb"] = base
    row["export_rss_over_shard"] = max(r / s for r, s in zip(rss, shard, strict=True))
    # What reading and building the stage added, over the process it started in (~60 MB:
    # the interpreter, numpy, OpenVINO and the file's header).
    row["export_growth_over_shard"] = max((r - b) / s for r, b, s in zip(rss, base, shard, strict=True))
    (one_stage,) = load_manifest(one).stages
    row["one_stage_export_rss_over_shard"] = (one_stage.export_peak_rss_mb or 0.0) / (
        (one / "stage0.bin").stat().st_size / 2**20)
    exact, fast, llama = [], [], []
    for _ in range(args.reps):
        exact.append(shardline_tok_s(one, "exact", args.tokens, args.threads))
        fast.append(shardline_tok_s(one, "fast", args.tokens, args.threads))
        if bin_dir is not None:
            llama.append(llama_bench_tok_s(bin_dir, model, args.tokens, args.threads))
    row["tok_s_exact"] = statistics.median(exact)
    row["tok_s_fast"] = statistics.median(fast)
    row["tok_s_llama_cpp"] = statistics.median(llama) if llama else None
    if llama:
        row["exact_over_llama_cpp"] = row["tok_s_exact"] / row["tok_s_llama_cpp"]
        row["fast_over_llama_cpp"] = row["tok_s_fast"] / row["tok_s_llama_cpp"]
    if not args.keep:
        model.unlink()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'type':<6}{'file MB':>9}{'shard/file':>12}{'RSS/shard':>11}{'growth/shard':>14}{'1-stage':>9}"
            f"{'exact tok/s':>13}{'fast tok/s':>12}{'llama.cpp':>11}{'exact/lc':>10}{'fast/lc':>9}")
    lines = [head]
    for r in rows:
        lc = r["tok_s_llama_cpp"]
        lines.append(f"{r['type']:<6}{r['file_mb']:>9.0f}{r['shard_over_file']:>12.3f}"
                     f"{r['export_rss_over_shard']:>11.2f}{r['export_growth_over_shard']:>14.2f}"
                     f"{r['one_stage_export_rss_over_shard']:>9.2f}{r['tok_s_exact']:>13.1f}{r['tok_s_fast']:>12.1f}"
                     + (f"{lc:>11.1f}{r['exact_over_llama_cpp']:>10.2f}{r['fast_over_llama_cpp']:>9.2f}" if lc
                        else f"{'-':>11}{'-':>10}{'-':>9}"))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(t for t in ALL_TYPES if t != "F32"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-model-files")
    p.add_argument("--quick", action="store_true", help="a 0.1B-class file, 16 tokens, 1 rep")
    p.add_argument("--keep", action="store_true", help="keep the generated GGUF files")
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.reps = 16, 1
        args.work = args.work.with_name(args.work.name + "-quick")
    bin_dir = None
    if not args.no_llama_cpp:
        bin_dir = Path(subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True)
                       .stdout.strip().splitlines()[-1])
    rows = []
    for kind in args.types.split(","):
        rows.append(measure(kind, args, bin_dir))
        print(f"{kind}: done", file=sys.stderr, flush=True)
    print(table(rows))
    figures = {k: {r["type"]: r.get(k) for r in rows} for k in (
        "shard_over_file", "export_rss_over_shard", "export_growth_over_shard", "one_stage_export_rss_over_shard",
        "exact_over_llama_cpp", "fast_over_llama_cpp",
        "tok_s_exact", "tok_s_fast", "tok_s_llama_cpp", "stage_export_rss_mb", "stage_export_base_mb", "stage_shard_mb",
        "file_mb")}
    print(json.dumps(figures | {"tokens": args.tokens, "reps": args.reps, "threads": args.threads,
                                "quick": args.quick}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
