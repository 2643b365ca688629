"""What heartbeats cost a busy chain: the same 2-worker daisy chain decoding back to back with
pings off, at the default window (5 s: a quiet link pinged every 1 s) and at the shortest one
(1 s: every 0.2 s). Each system is its own coordinator session on the same two workers; runs are
interleaved round by round. In a chain only the first worker's link is quiet while decoding (the
tokens come back on the last link), so that is where pings go; its pongs are counted from the
bytes that link received.

    python bench/heartbeat.py --quick     # 32 tokens, 2 reps
    python bench/heartbeat.py             # 128 tokens, 7 reps

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from kit import shard_folder, worker  # bench/ is on sys.path when this script runs
from pipeline import PROMPT, Sample, generate, started

from shardline.config import RunConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.remote import RemotePipeline
from shardline.wire.codec import encode
from shardline.wire.messages import Pong

SYSTEMS = {"off": 0.0, "default-5s": 5.0, "fastest-1s": 1.0}


def step_ms(runs: list[Sample]) -> float:
    return 1e3 * statistics.median(s for r in runs for s in r.step_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench" / "pipeline")
    args = p.parse_args()
    n, reps = (32, 2) if args.quick else (args.tokens, args.reps)
    folder = shard_folder(args.work, 3)
    prompt = ChatTokenizer(folder).encode_chat([{"role": "user", "content": PROMPT}])
    pong = len(encode(Pong(100)))  # bytes of one pong frame (seqs of 3 digits; close enough)
    load = os.getloadavg()[0]
    with started([worker(folder, 1), worker(folder, 2)]) as procs:
        addrs = [q.addr for q in procs]
        pipes = {name: RemotePipeline(folder, addrs, RunConfig(), "f16", "chain", heartbeat_s=h)
                 for name, h in SYSTEMS.items()}
        try:
            for pipe in pipes.values():
                generate(pipe, prompt, 4)  # warm-up
            samples: dict[str, list[Sample]] = {k: [] for k in pipes}
            pongs: dict[str, list[float]] = {k: [] for k in pipes}
            for _ in range(reps):
                for name, pipe in pipes.items():
                    before = pipe.links[0].bytes_received
                    s = generate(pipe, prompt, n)
                    samples[name].append(s)
                    pongs[name].append((pipe.links[0].bytes_received - before) / pong / s.decode_s)
        finally:
            for pipe in pipes.values():
                pipe.shutdown()
    off = step_ms(samples["off"])
    print(f"\n2-worker chain, {n} tokens x {reps} reps, load {load:.2f} at start; median decode step")
    print(f"{'system':<12} {'step ms':>8} {'tok/s':>7} {'vs off':>7} {'pings/s':>8}")
    figures: dict[str, float] = {}
    for name in pipes:
        ms = step_ms(samples[name])
        figures[f"{name}_vs_off"] = round(ms / off, 4)
        figures[f"{name}_step_ms"] = round(ms, 3)
        figures[f"{name}_pings_per_s"] = round(statistics.median(pongs[name]), 2)
        print(f"{name:<12} {ms:>8.2f} {1e3 / ms:>7.1f} {ms / off:>7.3f} {figures[f'{name}_pings_per_s']:>8.2f}")
    ratios = {k: v for k, v in figures.items() if k.endswith("_vs_off")}
    print(json.dumps(ratios | {k: v for k, v in figures.items() if k not in ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
