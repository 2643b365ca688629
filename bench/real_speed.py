"""Speed on a real model file (issue 39, point 5): Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`shardline
pull qwen2.5-coder-1.5b`), shardline against llama.cpp on the same file, side by side in one run:

- shardline 1 stage: `exact`, `fast`, and `fast` on the file re-blocked into groups of --reblock
  (`export --reblock G`: what the quality step, bench/quality.py, allows);
- llama.cpp alone: llama-bench at its defaults (`-p PROMPT -n TOKENS -t THREADS`);
- shardline over 3 processes (`export --stages 3 --balance`: stage 0 in a coordinator, two
  `shardline worker`s, mutual TLS on loopback) against llama.cpp's RPC over 2 ggml-rpc-servers
  (llama-bench and two servers: 3 processes too).

Reported: decode tok/s and time to first token, the bytes a token reads (the shard's, the
file's) against the machine's read bandwidth, peak RSS of every process. Rounds alternate the
systems; medians over rounds. Every process shares this machine's 2 cores: the chains measure
the cost of hops and processes, not a fleet's speed-up.

    python bench/real_speed.py                     # needs bench/llama_cpp_tools.sh; ~15 minutes
    python bench/real_speed.py --model qwen2.5-coder-0.5b --reps 1

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from big_model import bandwidth_gb_s, child_args, in_child, llama_bench, llama_rpc, shardline_chain  # noqa: E402
from model_files import TOOLS  # noqa: E402
from moe import medians, one_stage_run  # noqa: E402

from shardline.config import ExportConfig  # noqa: E402
from shardline.export.exporter import export  # noqa: E402
from shardline.export.pull import pull  # noqa: E402
from shardline.model.catalog import named  # noqa: E402
from shardline.model.manifest import load_manifest  # noqa: E402

CHAIN = 3  # processes: a coordinator and two workers, as llama-bench and two rpc-servers


def exported(model: Path, stages: int, work: Path, reblock: int | None = None) -> Path:
    out = work / f"{model.stem}-{stages}stage{'-balanced' if stages > 1 else ''}{f'-rb{reblock}' if reblock else ''}"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export(ExportConfig(out=out, model=model, stages=stages, balance=stages > 1, isolate=True, progress=False,
                            reblock=reblock))
    return out


def shard_bytes(folder: Path) -> int:
    return sum((folder / s.bin).stat().st_size for s in load_manifest(folder).stages)


def measure(model: Path, args: argparse.Namespace, bin_dir: Path) -> dict[str, dict[str, Any]]:
    """Every system once; the caller alternates rounds."""
    rows: dict[str, dict[str, Any]] = {}
    one = exported(model, 1, args.work)
    for precision in ("exact", "fast"):
        rows[f"shardline 1 stage {precision}"] = in_child(one_stage_run, str(one), precision, child_args(args))
    if args.reblock:
        rows[f"shardline 1 stage fast rb{args.reblock}"] = in_child(
            one_stage_run, str(exported(model, 1, args.work, args.reblock)), "fast", child_args(args))
    rows["llama.cpp alone"] = llama_bench(bin_dir, model, args, [])
    rows[f"shardline {CHAIN} processes exact"] = shardline_chain(exported(model, CHAIN, args.work), "exact", args,
                                                                 CHAIN)
    rows[f"shardline {CHAIN} processes fast"] = shardline_chain(exported(model, CHAIN, args.work), "fast", args, CHAIN)
    rows["llama.cpp RPC x2"] = llama_rpc(bin_dir, model, args, 2)
    return rows


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace, model: Path, gb_s: float) -> None:
    file_b = model.stat().st_size
    shard_b = {"": shard_bytes(exported(model, 1, args.work))}
    if args.reblock:
        shard_b[f"rb{args.reblock}"] = shard_bytes(exported(model, 1, args.work, args.reblock))
    print(f"{model.name}: {file_b / 1e9:.3f} GB file, shard {shard_b[''] / 1e9:.3f} GB"
          + (f" (re-blocked {shard_b[f'rb{args.reblock}'] / 1e9:.3f} GB)" if args.reblock else "")
          + f"; machine {gb_s:.1f} GB/s; {args.threads} threads per process; medians of {args.reps} rounds; "
            f"{args.prompt}-token prompt, {args.tokens} tokens")
    print(f"{'system':<34}{'tok/s':>7}{'GB/token':>9}{'of bound':>9}{'TTFT s':>8}  peak RSS MB per process")
    for name, r in rows.items():
        read = file_b if name.startswith("llama") else shard_b[f"rb{args.reblock}" if "rb" in name else ""]
        r["gb_per_token"], r["of_bound"] = read / 1e9, r["tok_s"] * read / (gb_s * 1e9)
        rss = [r["peak_rss_mb"], *r.get("worker_peak_rss_mb", []), *r.get("server_peak_rss_mb", [])]
        print(f"{name:<34}{r['tok_s']:>7.1f}{read / 1e9:>9.3f}{r['of_bound']:>9.2f}{r['ttft_s']:>8.2f}  "
              f"{', '.join(f'{x:.0f}' for x in rss)}")
    alone, rpc = rows["llama.cpp alone"]["tok_s"], rows["llama.cpp RPC x2"]["tok_s"]
    figures = {f"{k.removeprefix('shardline ').replace(' ', '_')}_over_llama_cpp": r["tok_s"] / alone
               for k, r in rows.items() if k.startswith("shardline 1 stage")}
    figures |= {f"processes_{CHAIN}_{p}_over_llama_rpc_2": rows[f"shardline {CHAIN} processes {p}"]["tok_s"] / rpc
                for p in ("exact", "fast")}
    figures = {k: round(v, 3) for k, v in figures.items()}
    print(json.dumps(figures | {"rows": rows, "file_bytes": file_b, "shard_bytes": shard_b, "machine_gb_s": gb_s,
                                "model": model.name, "tokens": args.tokens, "prompt": args.prompt, "reps": args.reps,
                                "threads": args.threads}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a name of `shardline pull`")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reblock", type=int, default=128, help="the re-blocked layout's group (0: none)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-real")
    args = p.parse_args()
    args.streams, args.verify_k = [1], 1
    bin_dir = Path(subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True)
                   .stdout.strip().splitlines()[-1])
    args.work.mkdir(parents=True, exist_ok=True)
    model = pull(named(args.model))
    rounds, args.reps = args.reps, 1  # llama-bench's own repetitions: one a round
    runs = [measure(model, args, bin_dir) for _ in range(rounds)]
    args.reps = rounds
    report(medians(runs), args, model, bandwidth_gb_s(args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
