"""A mixture of experts on one stage (issue 38, first figures): a random Q4_K_M file with
Qwen3-30B-A3B's shapes (128 experts, 8 used, hidden 2048, expert FFN 768, 32/4 heads of 128,
vocabulary 151936) but only `--layers` of its 48 layers, shardline (exact: experts kept as the
file's blocks inside the CPU plugin's GatherMatmul) against llama.cpp's llama-bench at its
defaults on the same file, side by side.

Reported: decode tok/s (a 16-token prompt, greedy) and peak RSS of each, alternating, medians;
the bytes a token reads (attention, router, norms and its 8 active experts per layer, the head)
against what the whole file would be; the read bandwidth each system reaches, against the
machine's (a 1 GiB numpy read, bench/big_model.py). Not yet here (issue 38, point 6): 2 and 4
worker processes, llama.cpp's RPC, TTFT, aggregate decode at 1/4/8 streams.

    python bench/moe.py                     # 4 layers; needs bench/llama_cpp_tools.sh
    python bench/moe.py --layers 8 --reps 3

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ggufs.py builds the files

from big_model import bandwidth_gb_s  # noqa: E402  (bench/ is on sys.path when this script runs)
from families import llama_bench, serve  # noqa: E402
from model_files import TOOLS, exported, tensor_bytes, vocab  # noqa: E402

from shardline.model.manifest import load_manifest  # noqa: E402
from tests.ggufs import Q4_K_M, FileSpec, write  # noqa: E402

EXPERTS, USED, HIDDEN, EXPERT_FFN, VOCAB = 128, 8, 2048, 768, 151936


def spec(layers: int) -> FileSpec:
    mix = Q4_K_M | {"ffn_down_exps:0": "Q6_K"}
    return FileSpec(name=f"bench-qwen3moe-{layers}", arch="qwen3moe", mix=mix, layers=layers, hidden=HIDDEN, heads=32,
                    kv_heads=4, head_size=128, ffn=6144, context=40960, rope_theta=1e6, rms_eps=1e-6, qk_norms=True,
                    experts=EXPERTS, experts_used=USED, expert_ffn=EXPERT_FFN, vocab=vocab(VOCAB))


def active_bytes(model: Path, layers: int) -> tuple[int, int]:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-moe")
    args = p.parse_args()
    bin_dir = Path(subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True)
                   .stdout.strip().splitlines()[-1])
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"bench-qwen3moe-{args.layers}.gguf"
    if not model.exists():
        write(spec(args.layers), model.with_suffix(".partial"), rng=np.random.default_rng(0))
        model.with_suffix(".partial").rename(model)
    folder = exported(model, 1, args.work)
    (stage,) = load_manifest(folder).stages
    ours, theirs = [], []
    for _ in range(args.reps):
        ours.append(serve(folder, "exact", args.tokens, args.threads))
        theirs.append(llama_bench(bin_dir, model, args.tokens, args.threads))
    read, total = active_bytes(model, args.layers)
    gb_s = bandwidth_gb_s(args.threads)
    row: dict[str, Any] = {
        "tok_s_shardline": statistics.median(r["tok_s"] for r in ours),
        "tok_s_llama_cpp": statistics.median(r["tok_s"] for r in theirs),
        "peak_rss_mb_shardline": statistics.median(r["peak_rss_mb"] for r in ours),
        "peak_rss_mb_llama_cpp": statistics.median(r["peak_rss_mb"] for r in theirs),
        "export_peak_rss_mb": stage.export_peak_rss_mb, "file_mb": tensor_bytes(model) / 2**20,
        "shard_mb": (folder / stage.bin).stat().st_size / 2**20, "active_mb_per_token": read / 2**20,
        "all_mb": total / 2**20, "machine_gb_s": gb_s, "layers": args.layers}
    row["shardline_over_llama_cpp"] = row["tok_s_shardline"] / row["tok_s_llama_cpp"]
    for who in ("shardline", "llama_cpp"):
        row[f"gb_s_{who}"] = row[f"tok_s_{who}"] * read / 1e9
    print(f"Qwen3-30B-A3B shapes, {args.layers} of 48 layers: {row['file_mb']:.0f} MB file, "
          f"{row['active_mb_per_token']:.0f} MB read per token; machine {gb_s:.1f} GB/s")
    print(f"{'system':<12}{'tok/s':>8}{'GB/s':>8}{'peak RSS MB':>13}")
    for who, name in (("shardline", "shardline"), ("llama_cpp", "llama.cpp")):
        print(f"{name:<12}{row[f'tok_s_{who}']:>8.1f}{row[f'gb_s_{who}']:>8.1f}{row[f'peak_rss_mb_{who}']:>13.0f}")
    first = {"shardline_over_llama_cpp": row.pop("shardline_over_llama_cpp")}
    print(json.dumps(first | row | {"tokens": args.tokens, "reps": args.reps, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
