"""The 2026 families on one stage (issue 37): a Gemma-3-shaped and a Qwen3-shaped random Q4_K_M
file, shardline against llama.cpp's llama-bench (its defaults) on the same file, side by side.

- Gemma 3 1B's shapes: 26 layers, hidden 1152, 4/1 heads of 256, FFN 6912, vocabulary 262144,
  tied, a 512-token window on five layers of six (rotary bases 1e6 global, 10000 local);
- Qwen3-0.6B's: 28 layers, hidden 1024, 16/8 heads of 128, FFN 3072, vocabulary 151936, tied.

Random blocks (tests/ggufs.py, Q4_K_M as llama.cpp mixes it; Gemma's hidden size 1152 is not a
multiple of 256, so, as llama.cpp's quantizer does, the matrices whose rows are 1152 long fall
back from K-quants to Q5_0 and Q8_0): fine where only size and speed matter. For each: decode
tok/s (exact and fast, a 16-token prompt, greedy) and llama-bench's
(`-p 0 -n TOKENS -t THREADS`), alternating, medians; the export's peak RSS (one process per
stage, from the manifest); the peak RSS of the process serving the stage and of llama-bench; and
the KV bytes per token, held whole on every layer (what shardline holds) and as a ring of W
slots on local layers would hold them past the window (not built: every layer's KV is one
growing state per stream in the stateful runner).

    python bench/families.py                 # needs bench/llama_cpp_tools.sh
    python bench/families.py --quick         # 4 layers each, 16 tokens, 1 rep

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ggufs.py builds the files

from kit import peak_rss_mb  # noqa: E402  (bench/ is on sys.path when this script runs)
from model_files import TOOLS, exported, shardline_tok_s, tensor_bytes, vocab  # noqa: E402

from shardline.model.manifest import load_manifest  # noqa: E402
from tests.ggufs import Q4_K_M, FileSpec, write  # noqa: E402

GEMMA_WINDOW = 512
F32 = 4  # bytes per KV element at exact precision


def specs(quick: bool) -> dict[str, FileSpec]:
    layers = (4, 4) if quick else (26, 28)
    mix = Q4_K_M | {"token_embd": "Q6_K"}  # tied: the embedding is the head, kept as llama.cpp keeps it
    # Rows of 1152: Q4_K -> Q5_0 and Q6_K -> Q8_0 (llama.cpp's fallback); attn_output and
    # ffn_down (rows of 1024 and 6912) keep their K-quants.
    gemma_mix = {"*": "Q5_0", "attn_output": "Q4_K", "ffn_down": "Q4_K", "ffn_down:0": "Q6_K", "attn_v:0": "Q8_0",
                 "token_embd": "Q8_0"}
    return {
        "gemma3": FileSpec(name="bench-gemma3", arch="gemma3", mix=gemma_mix, layers=layers[0], hidden=1152, heads=4,
                           kv_heads=1, head_size=256, ffn=6912, context=32768, rope_theta=1e6, rms_eps=1e-6,
                           tied=True, qk_norms=True, post_norms=True, vocab=vocab(262144),
                           extra_keys={"{arch}.attention.sliding_window": GEMMA_WINDOW}),
        "qwen3": FileSpec(name="bench-qwen3", arch="qwen3", mix=mix, layers=layers[1], hidden=1024, heads=16,
                          kv_heads=8, head_size=128, ffn=3072, context=40960, rope_theta=1e6, rms_eps=1e-6,
                          tied=True, qk_norms=True, vocab=vocab(151936)),
    }


def _serve_child(folder: str, precision: str, tokens: int, threads: int, out: Any) -> None:
    tok_s = shardline_tok_s(Path(folder), precision, tokens, threads)
    out.put({"tok_s": tok_s, "peak_rss_mb": peak_rss_mb()})


def serve(folder: Path, precision: str, tokens: int, threads: int) -> dict[str, float]:
    """Decode tok/s in a process of its own, and that process's peak RSS."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_serve_child, args=(str(folder), precision, tokens, threads, q))
    p.start()
    try:
        result: dict[str, float] = q.get(timeout=1800)
        return result
    finally:
        p.join(timeout=120)


def llama_bench(bin_dir: Path, model: Path, tokens: int, threads: int) -> dict[str, float]:
    """llama-bench at its defaults; its peak RSS from GNU time (the child's own, measured after exec)."""
    cmd = ["/usr/bin/time", "-f", "MAXRSS %M", str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n",
           str(tokens), "-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    (row,) = json.loads(done.stdout)
    rss = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("MAXRSS ")]
    return {"tok_s": float(row["avg_ts"]), "peak_rss_mb": rss[-1] / 1024}


def kv_bytes_per_token(spec: FileSpec, local: int) -> dict[str, float]:
    """Bytes of KV per token of context: every layer whole, and past the window with the local
    layers as rings (only the global layers grow)."""
    per_layer = 2 * spec.kv_heads * spec.head_dim * F32
    return {"whole": spec.layers * per_layer, "ring_past_window": (spec.layers - local) * per_layer}


def measure(name: str, spec: FileSpec, args: argparse.Namespace, bin_dir: Path) -> dict[str, Any]:
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{spec.name}.gguf"
    if not model.exists():
        write(spec, model.with_suffix(".partial"), rng=np.random.default_rng(0))
        model.with_suffix(".partial").rename(model)
    folder = exported(model, 1, work)
    (stage,) = load_manifest(folder).stages
    arch = load_manifest(folder).arch
    row: dict[str, Any] = {"family": name, "file_mb": tensor_bytes(model) / 2**20,
                           "shard_mb": (folder / stage.bin).stat().st_size / 2**20,
                           "export_peak_rss_mb": stage.export_peak_rss_mb, "local_layers": len(arch.local_layers),
                           "context": arch.max_context}
    exact, fast, llama = [], [], []
    for _ in range(args.reps):
        exact.append(serve(folder, "exact", args.tokens, args.threads))
        fast.append(serve(folder, "fast", args.tokens, args.threads))
        llama.append(llama_bench(bin_dir, model, args.tokens, args.threads))
    for key, runs in (("exact", exact), ("fast", fast), ("llama_cpp", llama)):
        row[f"tok_s_{key}"] = statistics.median(r["tok_s"] for r in runs)
        row[f"peak_rss_mb_{key}"] = statistics.median(r["peak_rss_mb"] for r in runs)
    row["exact_over_llama_cpp"] = row["tok_s_exact"] / row["tok_s_llama_cpp"]
    row["fast_over_llama_cpp"] = row["tok_s_fast"] / row["tok_s_llama_cpp"]
    kv = kv_bytes_per_token(spec, len(arch.local_layers))
    row["kv_bytes_per_token"], row["kv_bytes_per_token_ring"] = kv["whole"], kv["ring_past_window"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'family':<8}{'file MB':>9}{'shard MB':>10}{'export RSS':>12}{'exact':>8}{'fast':>8}{'llama.cpp':>11}"
            f"{'exact/lc':>10}{'fast/lc':>9}{'RSS exact':>11}{'RSS lc':>8}{'KV B/tok':>10}{'ring':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['family']:<8}{r['file_mb']:>9.0f}{r['shard_mb']:>10.0f}{r['export_peak_rss_mb']:>12.0f}"
                     f"{r['tok_s_exact']:>8.1f}{r['tok_s_fast']:>8.1f}{r['tok_s_llama_cpp']:>11.1f}"
                     f"{r['exact_over_llama_cpp']:>10.2f}{r['fast_over_llama_cpp']:>9.2f}"
                     f"{r['peak_rss_mb_exact']:>11.0f}{r['peak_rss_mb_llama_cpp']:>8.0f}"
                     f"{r['kv_bytes_per_token']:>10.0f}{r['kv_bytes_per_token_ring']:>8.0f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-families")
    p.add_argument("--quick", action="store_true", help="4 layers each, 16 tokens, 1 rep")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.reps = 16, 1
        args.work = args.work.with_name(args.work.name + "-quick")
    bin_dir = Path(subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True)
                   .stdout.strip().splitlines()[-1])
    rows = [measure(name, spec, args, bin_dir) for name, spec in specs(args.quick).items()]
    print(table(rows))
    keys = ("exact_over_llama_cpp", "fast_over_llama_cpp", "tok_s_exact", "tok_s_fast", "tok_s_llama_cpp",
            "export_peak_rss_mb", "peak_rss_mb_exact", "peak_rss_mb_fast", "peak_rss_mb_llama_cpp", "file_mb",
            "shard_mb", "kv_bytes_per_token", "kv_bytes_per_token_ring", "local_layers", "context")
    figures = {k: {r["family"]: r[k] for r in rows} for k in keys}
    print(json.dumps(figures | {"tokens": args.tokens, "reps": args.reps, "threads": args.threads,
                                "quick": args.quick}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
