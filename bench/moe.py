"""A mixture of experts on one PC and split over processes (issue 38, point 6): a random Q4_K_M
file with Qwen3-30B-A3B's shapes (128 experts, 8 used, hidden 2048, expert FFN 768, 32/4 heads
of 128, vocabulary 151936) but only `--layers` of its 48 layers, side by side in one run:

- shardline 1 stage, `exact` and `fast` (experts kept as the file's blocks inside the CPU
  plugin's GatherMatmul);
- shardline over 2 and 4 processes (`export --balance`: the head counted as the active layers it
  weighs; stage 0 in a coordinator, the rest on `shardline worker`s, mutual TLS on loopback);
- llama.cpp alone (llama-bench at its defaults) and over its RPC (2 and 4 ggml-rpc-servers on
  loopback holding every layer, split by layer).

Reported: decode tok/s and time to first token (a `--prompt`-token prompt), peak RSS of every
process; aggregate decode at 1, 4 and 8 streams in one decode group (rows route to different
experts, so a group reads more of them); the bytes a token reads (attention, router, norms and
its 8 active experts per layer, the head) against the machine's read bandwidth (a 1 GiB numpy
read, bench/big_model.py). Every process shares this machine's 2 cores: the chains measure the
hops' and processes' cost, not a fleet's speed-up.

    python bench/moe.py                     # 8 layers, about 25 minutes; needs bench/llama_cpp_tools.sh
    python bench/moe.py --layers 4 --reps 1

The last line is one JSON object, ratios first.
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

from big_model import (  # noqa: E402  (bench/ is on sys.path when this script runs)
    _aggregate,
    _timed_stream,
    bandwidth_gb_s,
    child_args,
    in_child,
    llama_bench,
    llama_rpc,
    shardline_chain,
)
from kit import peak_rss_mb  # noqa: E402
from model_files import TOOLS, tensor_bytes, vocab  # noqa: E402

from shardline.config import ExportConfig, RunConfig  # noqa: E402
from shardline.export.exporter import export  # noqa: E402
from shardline.model.manifest import load_manifest  # noqa: E402
from tests.ggufs import Q4_K_M, FileSpec, write  # noqa: E402

EXPERTS, USED, HIDDEN, EXPERT_FFN, VOCAB = 128, 8, 2048, 768, 151936
CHAINS = (2, 4)


def spec(layers: int) -> FileSpec:
    mix = Q4_K_M | {"ffn_down_exps:0": "Q6_K"}
    return FileSpec(name=f"bench-qwen3moe-{layers}", arch="qwen3moe", mix=mix, layers=layers, hidden=HIDDEN, heads=32,
                    kv_heads=4, head_size=128, ffn=6144, context=40960, rope_theta=1e6, rms_eps=1e-6, qk_norms=True,
                    experts=EXPERTS, experts_used=USED, expert_ffn=EXPERT_FFN, vocab=vocab(VOCAB))


def active_bytes(model: Path) -> tuple[int, int]:
    """(bytes one token reads, bytes of all tensors): every tensor whole but the experts' (8 of
    128 read), and the embedding (one row)."""
    from gguf import GGUFReader

    read = total = 0
    for t in GGUFReader(str(model)).tensors:
        n = int(t.n_bytes)
        total += n
        if "_exps." in t.name:
            read += n * USED // EXPERTS
        elif t.name == "token_embd.weight":
            read += n // VOCAB
        else:
            read += n
    return read, total


def exported(model: Path, stages: int, work: Path) -> Path:
    out = work / f"{model.stem}-{stages}stage{'-balanced' if stages > 1 else ''}"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export(ExportConfig(out=out, model=model, stages=stages, balance=stages > 1, isolate=True, progress=False))
    return out


def one_stage_run(folder: str, precision: str, args: dict[str, Any], out: Any) -> None:
    from shardline.pipeline.local import LocalPipeline

    with LocalPipeline(Path(folder), RunConfig(precision=precision, threads=args["threads"],
                                               context=args["context"])) as pipe:
        ttft, tok_s = _timed_stream(pipe, args["prompt"], args["tokens"])
        agg = {n: _aggregate(pipe, n, args["tokens"], args["context"]) for n in args["streams"]}
    out.put({"ttft_s": ttft, "tok_s": tok_s, "aggregate": agg, "peak_rss_mb": peak_rss_mb()})


def measure(model: Path, args: argparse.Namespace, bin_dir: Path) -> dict[str, dict[str, Any]]:
    """Every system once; the caller alternates reps."""
    rows: dict[str, dict[str, Any]] = {}
    one = exported(model, 1, args.work)
    for precision in ("exact", "fast"):
        rows[f"shardline 1 stage {precision}"] = in_child(one_stage_run, str(one), precision, child_args(args))
    for n in CHAINS:
        rows[f"shardline {n} processes"] = shardline_chain(exported(model, n, args.work), "exact", args, n)
    rows["llama.cpp alone"] = llama_bench(bin_dir, model, args, [])
    for n in CHAINS:
        rows[f"llama.cpp RPC x{n}"] = llama_rpc(bin_dir, model, args, n)
    return rows


def medians(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, first in runs[0].items():
        row: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, (int, float)):
                row[key] = statistics.median(r[name][key] for r in runs)
            elif isinstance(value, dict):
                row[key] = {k: statistics.median(r[name][key][k] for r in runs) for k in value}
            else:  # per-process lists: the last run's
                row[key] = runs[-1][name][key]
        out[name] = row
    return out


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace, model: Path, gb_s: float) -> None:
    read, total = active_bytes(model)
    bound = gb_s * 1e9 / read
    print(f"Qwen3-30B-A3B shapes, {args.layers} of 48 layers: {tensor_bytes(model) / 2**20:.0f} MiB file, "
          f"{read / 2**20:.0f} MiB read per token of {total / 2**20:.0f}; machine {gb_s:.1f} GB/s: bound "
          f"{bound:.1f} tok/s; {args.threads} threads per process, medians of {args.reps}")
    print(f"{'system':<26}{'tok/s':>7}{'of bound':>9}{'TTFT s':>8}{'agg 1/4/8 tok/s':>18}  peak RSS MB per process")
    for name, r in rows.items():
        agg = "/".join(f"{r['aggregate'][n]:.1f}" for n in args.streams) if "aggregate" in r else "-"
        rss = [r["peak_rss_mb"], *r.get("worker_peak_rss_mb", []), *r.get("server_peak_rss_mb", [])]
        print(f"{name:<26}{r['tok_s']:>7.1f}{r['tok_s'] / bound:>9.2f}{r['ttft_s']:>8.2f}{agg:>18}  "
              f"{', '.join(f'{x:.0f}' for x in rss)}")
    one, alone = rows["shardline 1 stage exact"], rows["llama.cpp alone"]
    figures: dict[str, Any] = {
        "one_stage_exact_over_llama_cpp": one["tok_s"] / alone["tok_s"],
        "one_stage_fast_over_llama_cpp": rows["shardline 1 stage fast"]["tok_s"] / alone["tok_s"]}
    for n in CHAINS:
        chain = rows[f"shardline {n} processes"]
        figures[f"processes_{n}_over_one_stage"] = chain["tok_s"] / one["tok_s"]
        figures[f"processes_{n}_over_llama_rpc_{n}"] = chain["tok_s"] / rows[f"llama.cpp RPC x{n}"]["tok_s"]
    figures = {k: round(v, 3) for k, v in figures.items()}
    print(json.dumps(figures | {"rows": rows, "active_mb_per_token": read / 2**20, "file_mb": total / 2**20,
                                "machine_gb_s": gb_s, "bound_tok_s": bound, "layers": args.layers,
                                "stages": {n: [(s.first_layer, s.last_layer) for s in load_manifest(
                                    exported(model, n, args.work)).stages] for n in (1, *CHAINS)},
                                "tokens": args.tokens, "prompt": args.prompt, "reps": args.reps,
                                "threads": args.threads}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--streams", default="1,4,8")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-moe")
    args = p.parse_args()
    args.streams, args.verify_k = [int(s) for s in args.streams.split(",")], 1
    bin_dir = Path(subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True)
                   .stdout.strip().splitlines()[-1])
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"bench-qwen3moe-{args.layers}.gguf"
    if not model.exists():
        write(spec(args.layers), model.with_suffix(".partial"), rng=np.random.default_rng(0))
        model.with_suffix(".partial").rename(model)
    llama_reps, args.reps = args.reps, 1  # llama-bench's own repetitions: one a round
    runs = [measure(model, args, bin_dir) for _ in range(llama_reps)]
    args.reps = llama_reps
    report(medians(runs), args, model, bandwidth_gb_s(args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
