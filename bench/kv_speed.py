"""What the KV cache's precision costs in speed (issue 39, point 4: what `fast` means by default).

One stage of a real file (`shardline pull`, default the 1.5B) under `--precision fast`, its KV
cache kept as f32, f16 and u8, side by side in one run: decode tok/s of one stream after a short
and a long prompt (the longer the past, the more of each step is the cache's read), its time to
first token, and the process's peak RSS. Each run is a process of its own; rounds alternate
the precisions; medians over rounds. bench/quality.py measures what each precision costs in
agreement with the fp32 reference.

    python bench/kv_speed.py                       # ~10 minutes on 2 cores
    python bench/kv_speed.py --prompts 128 --reps 1

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from big_model import _timed_stream, in_child  # noqa: E402
from kit import peak_rss_mb  # noqa: E402
from real_speed import exported  # noqa: E402

from shardline.config import RunConfig  # noqa: E402
from shardline.export.pull import pull  # noqa: E402
from shardline.model.catalog import named  # noqa: E402

KVS = ("f32", "f16", "u8")


def run_kv(folder: str, kv: str, args: dict[str, Any], out: Any) -> None:
    from shardline.pipeline.local import LocalPipeline

    rows: dict[str, Any] = {}
    config = RunConfig(precision="fast", kv_precision=kv, threads=args["threads"], context=args["context"])
    with LocalPipeline(Path(folder), config) as pipe:
        for n in args["prompts"]:
            ttft, tok_s = _timed_stream(pipe, n, args["tokens"])
            rows[str(n)] = {"ttft_s": ttft, "tok_s": tok_s}
    out.put({"prompts": rows, "peak_rss_mb": peak_rss_mb()})


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    return {"peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "prompts": {n: {k: statistics.median(r["prompts"][n][k] for r in runs) for k in first["prompts"][n]}
                        for n in first["prompts"]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a name of `shardline pull`")
    p.add_argument("--prompts", default="128,2048", help="prompt lengths (comma-separated)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-real")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    if args.reps < 1 or args.tokens < 1 or min(prompts) < 1:
        p.error("--reps, --tokens and every prompt length must be positive")
    model = pull(named(args.model))
    folder = exported(model, 1, args.work)
    child = {"threads": args.threads, "prompts": prompts, "tokens": args.tokens,
             "context": max(prompts) + args.tokens + 16}
    runs: dict[str, list[dict[str, Any]]] = {kv: [] for kv in KVS}
    for rep in range(args.reps):
        for kv in KVS if rep % 2 == 0 else KVS[::-1]:
            runs[kv].append(in_child(run_kv, str(folder), kv, child))
            print(f"round {rep + 1} {kv}: " + ", ".join(f"{n}: {r['tok_s']:.1f} tok/s"
                                                       for n, r in runs[kv][-1]["prompts"].items()), file=sys.stderr)
    rows = {kv: medians(r) for kv, r in runs.items()}

    print(f"{model.name}, 1 stage, --precision fast, {args.threads} threads, {args.tokens} tokens, "
          f"medians of {args.reps} rounds")
    print(f"{'KV':<5}" + "".join(f"{f'tok/s @{n}':>13}{f'TTFT s @{n}':>13}" for n in prompts) + f"{'peak RSS MB':>13}")
    for kv, r in rows.items():
        print(f"{kv:<5}" + "".join(f"{r['prompts'][str(n)]['tok_s']:>13.1f}{r['prompts'][str(n)]['ttft_s']:>13.2f}"
                                   for n in prompts) + f"{r['peak_rss_mb']:>13.0f}")
    def tok_s(kv: str, n: int) -> float:
        return float(rows[kv]["prompts"][str(n)]["tok_s"])

    figures = {f"{kv}_over_u8_tok_s_at_{n}": tok_s(kv, n) / tok_s("u8", n) for kv in ("f16", "f32") for n in prompts}
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}
                     | {"rows": rows, "model": model.name, "reps": args.reps, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
