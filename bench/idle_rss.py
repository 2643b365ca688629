"""Idle RSS of `shardline serve` and of a `shardline worker` against the shards' bytes (issue 54).

`serve` with no flags (the default model, SmolLM2-135M, its 2 paged stages), and a `worker` on
stage 1 of that export: before any session, with a coordinator's session joined (a `serve
--workers` in front of it, its Hello asking for the pool serve sizes by default), and after one
request through it. Each process is read `--settle` seconds after the event (past the 30 s
after which a long-running process first gives glibc's free heap back: host.trim_memory_every).
Target: at most 1.3x the shards' bytes (the .bin files of the export) at idle.

Every tree runs on a private copy of the export (SHARDLINE_CACHE pointed at `--work`): a shard
file another process maps (another serve on the shared cache) keeps its pages resident in this
one too (MADV_PAGEOUT drops only pages no one else maps: stage/resident.py), which would charge
the process with pages it gave back.

    python bench/idle_rss.py                                              # this tree
    python bench/idle_rss.py --before /work/main/.venv/bin/shardline --runs 3
    python bench/idle_rss.py --breakdown                                  # where serve's memory goes

A table of medians, then one JSON line (ratios first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kit import SHARDLINE, Proc  # bench/ is on sys.path when this script runs

MiB = 2**20
TARGET = 1.3
# What is read, per tree, in this order.
POINTS = ("serve idle", "serve after a request", "worker alone", "worker with a session", "worker after a request")


def memory(pid: int) -> tuple[float, float, float]:
    """(RSS, RssAnon, RssFile) of `pid` in MiB (/proc/PID/status)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kib = {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile")}
    return kib["VmRSS"] / 1024, kib["RssAnon"] / 1024, kib["RssFile"] / 1024


def private_export(work: Path) -> tuple[Path, Path]:
    """(a private cache holding a copy of the default paged export, the copy), made once."""
    from shardline.export.defaults import default_shards

    source = default_shards()
    cache = work / "cache"
    copy = cache / source.name
    if not (copy / "manifest.json").exists():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(source, copy)
    return cache, copy


def ask(url: str) -> None:
    """One short chat request, answered whole."""
    with urllib.request.urlopen(f"{url}/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Name three colours."}]}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.load(r)["choices"][0]["message"]["content"]


def settled(pid: int, settle_s: float) -> tuple[float, float, float]:
    time.sleep(settle_s)
    return memory(pid)


def serve(exe: str, env: dict[str, str], args: list[str]) -> Proc:
    return Proc(["serve", "--port", "0", *args], "serving ", timeout_s=1800, stream="stderr", exe=exe, env=env)


def one_run(exe: str, env: dict[str, str], folder: Path, settle_s: float) -> dict[str, tuple[float, float, float]]:
    """Every point of POINTS for one tree's `shardline`."""
    out = {}
    server = serve(exe, env, [])  # no flags: the default model's export, found in the private cache
    try:
        out["serve idle"] = settled(server.proc.pid, settle_s)
        ask(server.url)
        out["serve after a request"] = settled(server.proc.pid, settle_s)
    finally:
        server.stop()
    worker = Proc(["worker", "--shards", str(folder), "--stage", "1", "--insecure"], "listening on",
                  timeout_s=600, exe=exe, env=env)
    try:
        out["worker alone"] = settled(worker.proc.pid, settle_s)
        front = serve(exe, env, ["--shards", str(folder), "--workers", worker.addr, "--insecure"])
        try:
            out["worker with a session"] = settled(worker.proc.pid, settle_s)
            ask(front.url)
            out["worker after a request"] = settled(worker.proc.pid, settle_s)
        finally:
            front.stop()
    finally:
        worker.stop()
    return out


def breakdown(folder: Path) -> list[tuple[str, float]]:
    """Where this tree's serve holds its memory, one part at a time in this (fresh) process: RSS
    after each, glibc's free heap given back first. Then what the largest step so far keeps (the
    plugin's intermediate buffers), and what CompiledModel.release_memory gives back of it."""
    import ctypes
    import gc

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    rows: list[tuple[str, float]] = []

    def read(what: str) -> None:
        gc.collect()
        trim(0)
        rows.append((what, memory(os.getpid())[0]))

    read("python")
    import numpy as np
    import openvino as ov

    read("numpy, openvino imported")
    import shardline.server  # noqa: F401 - what serve imports
    from shardline.api.app import build_app  # noqa: F401
    from shardline.config import RunConfig
    from shardline.model.grammar import Grammars
    from shardline.model.manifest import load_manifest
    from shardline.model.paged_ir import joined
    from shardline.model.tokenizer import ChatTokenizer
    from shardline.stage.block_ops import read_stage
    from shardline.stage.paged_batch import PagedBatch
    from shardline.stage.paged_runner import WARM_CHUNK, PagedRunner
    from shardline.stage.resident import release_file_pages, released_while
    from shardline.stage.runner import precision_properties

    read("the API's imports")
    class Cold(PagedRunner):
        def _warm_up(self) -> None:  # done below a call at a time, as PagedRunner.load does it
            pass

    m, core = load_manifest(folder), ov.Core()
    stages: list[PagedRunner] = []
    for e in m.stages:
        read, weights_file = read_stage(core, folder / e.xml, RunConfig())
        model = joined(read)
        with released_while(weights_file):
            stage = Cold(model, "CPU", precision_properties(model, RunConfig()), 1, core, m.arch.vocab, 8192)
            del model
            release_file_pages(folder / e.bin)  # each reading without the mapped shard's pages
            read(f"{e.name} compiled")
            scratch = stage.pool(1)
            for n in (1, WARM_CHUNK):  # the two kinds of matmul kernel, each with its own copy
                x = np.zeros(n, np.int64) if stage.hidden is None else np.zeros((n, stage.hidden), np.float32)
                stage.run(PagedBatch.of([(n, 0, (0,))], logits_at=[n - 1] if stage.has_head else []), x, scratch)
                release_file_pages(folder / e.bin)
                read(f"{e.name} after a {n}-token call")
        stages.append(stage)
    tok = ChatTokenizer(folder)
    read("tokenizer (two Tokenizers)")
    Grammars((folder / "tokenizer.json").read_text(), m.arch.vocab, tok.stop_ids).tokenizer()
    read("llguidance's vocabulary")
    for s in stages:
        s.allocate(64)
    past = 0
    for n in (128, 512):
        batch = PagedBatch.of([(n, past, tuple(range(-(-(past + n) // 32))))], logits_at=[n - 1])
        x = np.arange(n, dtype=np.int64)
        for s in stages:
            x = np.array(s.run(batch, x))
        past += n
        read(f"after a {n}-token step")
    for s in stages:
        s.compiled.release_memory()
    read("release_memory")
    return rows


def medians(runs: list[dict[str, tuple[float, float, float]]]) -> dict[str, list[float]]:
    return {p: [statistics.median(r[p][i] for r in runs) for i in range(3)] for p in POINTS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="another tree's `shardline` executable, measured the same way first")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--settle", type=float, default=35.0, help="seconds after each event before reading")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-idle-rss")
    p.add_argument("--breakdown", action="store_true", help="only where this tree's serve holds its memory")
    p.add_argument("--inner", type=Path, help=argparse.SUPPRESS)  # the breakdown's own fresh process
    args = p.parse_args()
    if args.inner:
        print(json.dumps(breakdown(args.inner)))
        return 0
    cache, folder = private_export(args.work)
    if args.breakdown:
        run = subprocess.run([sys.executable, __file__, "--inner", str(folder)], capture_output=True, text=True,
                             check=True)
        rows = json.loads(run.stdout.strip().splitlines()[-1])
        last = 0.0
        for what, rss in rows:
            print(f"{what:<34}{rss:>8.0f} MiB{rss - last:>+9.0f}")
            last = rss
        print(json.dumps({"breakdown_mib": {w: round(r) for w, r in rows}}))
        return 0
    env = {**os.environ, "SHARDLINE_CACHE": str(cache)}
    stages = sorted(folder.glob("*.bin"))
    shard_mib = sum(f.stat().st_size for f in stages) / MiB
    stage1_mib = (folder / "stage1.bin").stat().st_size / MiB
    trees = ([("before", args.before)] if args.before else []) + [("after", SHARDLINE)]
    runs: dict[str, list[dict[str, tuple[float, float, float]]]] = {name: [] for name, _ in trees}
    for _ in range(args.runs):  # interleaved: a noisy spell touches both trees alike
        for name, exe in trees:
            runs[name].append(one_run(exe, env, folder, args.settle))
    figures = {name: medians(r) for name, r in runs.items()}
    print(f"shards: {shard_mib:.1f} MiB ({', '.join(f.name for f in stages)}); stage 1: {stage1_mib:.1f} MiB; "
          f"medians of {args.runs} runs, read {args.settle:g} s after each event")
    print(f"{'tree':<8}{'point':<26}{'RSS MiB':>9}{'anon':>8}{'file':>8}{'x shards':>10}")
    for name, points in figures.items():
        for point, (rss, anon, file) in points.items():
            own = shard_mib if point.startswith("serve") else stage1_mib
            print(f"{name:<8}{point:<26}{rss:>9.0f}{anon:>8.0f}{file:>8.0f}{rss / own:>10.2f}")
    ratios = {f"{name} {point} / shards": round(v[0] / (shard_mib if point.startswith("serve") else stage1_mib), 3)
              for name, points in figures.items() for point, v in points.items()}
    print(json.dumps(ratios | {"target": TARGET, "shard_mib": round(shard_mib, 1), "stage1_mib": round(stage1_mib, 1),
                               "rss_anon_file_mib": {n: {k: [round(x) for x in v] for k, v in pts.items()}
                                                     for n, pts in figures.items()},
                               "runs": args.runs, "settle_s": args.settle}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
