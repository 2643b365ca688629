"""Decode tok/s of this code against an older commit, each measured by its own bench scripts,
interleaved in one run (issue 9: decode at 1 to 8 streams must not regress).

The old commit is a git worktree (`git worktree add --detach /work/wt-old 9975485`); its scripts
run with PYTHONPATH=<worktree>/src (and a cache and bench folder of their own: older code
exports an older manifest format). Each round runs, old and new in alternating order:
- bench/decode_groups.py (its part 1: the engine on the default 2-stage export in one process,
  2 threads; decode groups 0, 1 (the local default) and 2; 1, 2, 4, 8 streams), `--rates ""`;
- bench/serving.py's part 1 (stage 0 here on core 0, stage 1 in a `shardline worker` on core
  1, one thread each; groups 0, 1, 2 (2, one per stage, is the default with workers)).
- burst_local and burst_remote: the same bursts (1, 2, 4, 8 streams submitted at once; local
  with one group, remote with two) through either tree's engine, measured three ways: the
  scripts' aggregate figure, the makespan (every token over submit -> last token) and the
  steady state (streams / step time while every stream decodes), with the first token's time.
Before each round the machine must be quiet (bench/quiet.py); every invocation records whether
a pytest ran meanwhile. Medians over rounds, and the median of the per-round new/old ratios.

    python bench/regress.py --old /work/wt-old --rounds 5
    python bench/regress.py --old /work/wt-old --rounds 1 --tokens 16     # smoke run

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kit import pytest_running, wait_quiet  # bench/ is on sys.path when this script runs

NEW = Path(__file__).resolve().parents[1]
COUNTS = (1, 2, 4, 8)
GROUPS = (0, 1, 2)
# the decode groups each setting serves with by default
DEFAULTS = {"decode_groups": 1, "serving": 2, "burst_local": 1, "burst_remote": 2}

SERVING_SHIM = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
os.sched_setaffinity(0, {{0}})  # as serving.py's main: this process on core 0, the worker on core 1
import serving
import shardline
try:
    from kit import shard_folder
except ImportError:  # a tree before bench/kit.py
    from shards import shard_folder
from shardline.model.tokenizer import ChatTokenizer
print("shardline from", shardline.__file__, file=sys.stderr)
folder = shard_folder(Path({work!r}), 2, balance=True)
prompt = ChatTokenizer(folder).encode_chat([{{"role": "user", "content": serving.PROMPT}}])
print(json.dumps(serving.part1(folder, prompt, {tokens}, {reps}, True)))
"""


# The same burst of streams through either tree's engine (its API detected), measured three ways:
# the scripts' aggregate (from the first stream's first token), the makespan (every token over
# submit -> last token) and the steady state (step time while every stream decodes).
BURST_SHIM = """
import json, os, statistics, sys, threading, time
from pathlib import Path
sys.path.insert(0, {bench!r})
try:
    from kit import Proc, shard_folder
except ImportError:  # a tree before bench/kit.py
    from procs import Proc
    from shards import shard_folder
from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Request
mode, groups, n, reps = {mode!r}, {groups}, {tokens}, {reps}
folder = shard_folder(Path({work!r}), 2, balance=True)
try:
    from shardline.serving.scheduler import SchedulerConfig
    new, extra = True, {{}}
except ImportError:
    new, extra = False, {{"groups": groups}}
worker = None
if mode == "remote":  # as serving.py: this process on core 0, the worker on core 1, one thread each
    os.sched_setaffinity(0, {{0}})
    import importlib.util  # trees with TLS (issue 11) want --insecure for links in clear; older ones know no such flag
    clear = ["--insecure"] if importlib.util.find_spec("shardline.wire.tls") else []
    worker = Proc(["worker", "--shards", str(folder), "--stage", "1", "--listen", "127.0.0.1:0", "--threads", "1",
                   *clear], "listening on ", cpus="1")
    from shardline.pipeline.remote import RemotePipeline
    pipe = RemotePipeline(folder, [worker.line.split()[-1]], RunConfig(threads=1), **extra)  # either tree's Proc
else:
    from shardline.pipeline.local import LocalPipeline
    pipe = LocalPipeline(folder, RunConfig(), **extra)
engine = (Engine(pipe, Limits(8, 8), 8192, SchedulerConfig(groups=groups)) if new
          else Engine(pipe, Limits(8, 8), 8192))
texts = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a bicycle stays upright.", "List five uses of a paperclip.", "What is the capital of France?"]
tok = ChatTokenizer(folder)
chats = [tok.encode_chat([{{"role": "user", "content": t}}]) for t in texts]

def burst(s):
    done, stamps = threading.Semaphore(0), [[] for _ in range(s)]
    def col(i):
        def on(ev):
            if ev.token is not None:
                stamps[i].append(time.perf_counter())
            if ev.finish:
                done.release()
        return on
    t0 = time.perf_counter()
    for i in range(s):
        engine.submit(Request(chats[i % 4], SamplingConfig(max_tokens=n), frozenset()), col(i))
    for _ in range(s):
        assert done.acquire(timeout=600)
    first, last = min(x[0] for x in stamps), max(x[-1] for x in stamps)
    lo, hi = max(x[1] for x in stamps), min(x[-1] for x in stamps)
    gaps = [b - a for x in stamps for a, b in zip(x, x[1:]) if a >= lo and b <= hi]
    return {{"aggregate": sum(len(x) - 1 for x in stamps) / (last - first),
            "makespan": sum(len(x) for x in stamps) / (last - t0),
            "steady": s / statistics.median(gaps) if gaps else float("nan"), "first_ms": 1e3 * (first - t0),
            "spread_ms": 1e3 * (max(x[0] for x in stamps) - first)}}

try:
    burst(2)
    out = {{}}
    for s in (1, 2, 4, 8):
        runs = [burst(s) for _ in range(reps)]
        out[f"g{{groups}}-s{{s}}"] = {{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    print(json.dumps(out))
finally:
    engine.stop()
    if worker is not None:
        pipe.shutdown()
        worker.stop()
"""
BURSTS = {"burst_local": ("local", 1), "burst_remote": ("remote", 2)}  # the default groups of each


def env_for(root: Path, work: Path) -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(root / "src"), "SHARDLINE_CACHE": str(work / "cache")}


def which_shardline(root: Path, work: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "import shardline; print(shardline.__file__)"], env=env_for(root, work),
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


class Watch:
    """Samples, every 2 s while a run lasts, whether a pytest is running and the load average."""

    def __init__(self) -> None:
        self.pytest = False
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self.pytest |= pytest_running()
            self.loads.append(os.getloadavg()[0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def invoke(bench: str, root: Path, work: Path, tokens: int, reps: int, timeout_s: float) -> dict[str, Any]:
    """One run of `bench` from the tree at `root`: aggregate decode tok/s per "g{G}-s{S}"."""
    if bench == "decode_groups":
        cmd = [sys.executable, str(root / "bench" / "decode_groups.py"), "--rates", "", "--reps", str(reps),
               "--tokens", str(tokens), "--work", str(work / "bench")]
    elif bench == "serving":
        shim = SERVING_SHIM.format(bench=str(root / "bench"), work=str(work / "bench"), tokens=tokens, reps=reps)
        cmd = [sys.executable, "-c", shim]
    else:
        mode, groups = BURSTS[bench]
        shim = BURST_SHIM.format(bench=str(root / "bench"), work=str(work / "bench"), tokens=tokens, reps=reps,
                                 mode=mode, groups=groups)
        cmd = [sys.executable, "-c", shim]
    watch = Watch()
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        out = subprocess.run(cmd, env=env_for(root, work), capture_output=True, text=True, timeout=timeout_s,
                             cwd=str(root))
    finally:
        watch.stop()
    if out.returncode != 0:
        raise RuntimeError(f"{bench} from {root} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    last = json.loads(out.stdout.strip().splitlines()[-1])
    burst: dict[str, dict[str, float]] = {}
    if bench == "decode_groups":
        tps = {k: float(v) for k, v in last["decode_tok_s"].items()}
    elif bench == "serving":  # "groups{G}-streams{S}"
        tps = {f"g{k.split('-')[0][6:]}-s{k.split('-')[1][7:]}": float(v) for k, v in last.items()}
    else:  # the scripts' own figure is the aggregate; the others as well, apart
        burst, tps = last, {k: float(v["aggregate"]) for k, v in last.items()}
    return {"tok_s": tps, "burst": burst, "seconds": round(time.perf_counter() - start, 1),
            "load_start": round(load0, 2), "load_max": round(max(watch.loads, default=load0), 2),
            "pytest_seen": watch.pytest}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="a worktree of the older commit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=1, help="reps inside each invocation")
    p.add_argument("--benches", default="decode_groups,serving,burst_local,burst_remote")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-regress")
    p.add_argument("--max-wait", type=float, default=1200.0, help="seconds to wait for a quiet machine per round")
    p.add_argument("--max-minutes", type=float, default=120.0, help="no new round after this")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per invocation")
    args = p.parse_args()
    benches = args.benches.split(",")
    sides = {"old": (args.old.resolve(), args.work / "old"), "new": (NEW, args.work / "new")}
    for name, (root, work) in sides.items():
        (work / "bench").mkdir(parents=True, exist_ok=True)
        where = which_shardline(root, work)
        print(f"{name}: shardline from {where}", file=sys.stderr)
        if not where.startswith(str(root)):
            raise SystemExit(f"{name}: imports shardline from {where}, not from {root}/src")
    deadline = time.monotonic() + args.max_minutes * 60
    for root, work in sides.values():  # exports (and first compilations) outside the timed rounds
        for bench in benches:
            invoke(bench, root, work, 4, 1, args.timeout)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    quiet_rounds = 0
    for r in range(args.rounds):
        if r and time.monotonic() > deadline:
            print(f"time box: stopping after {r} rounds", file=sys.stderr)
            break
        quiet, load = wait_quiet(max_wait_s=args.max_wait)
        quiet_rounds += quiet
        for bench in benches:
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                root, work = sides[side]
                if pytest_running():
                    wait_quiet(max_load=99.0, max_wait_s=args.max_wait)
                x = invoke(bench, root, work, args.tokens, args.reps, args.timeout)
                runs.setdefault((bench, side), []).append(x)
                print(f"round {r + 1}/{args.rounds} {bench} {side}: " + " ".join(
                    f"{k} {v:.1f}" for k, v in x["tok_s"].items()) + f" (load {x['load_start']}-{x['load_max']}"
                    f"{', pytest ran' if x['pytest_seen'] else ''}, round quiet: {quiet} at {load:.2f})",
                    file=sys.stderr, flush=True)

    table: dict[str, dict[str, float]] = {}
    figures: dict[str, Any] = {}
    print(f"\nnew ({NEW}) vs old ({args.old}): aggregate decode tok/s, {args.tokens} tokens per stream, "
          f"{len(runs.get((benches[0], 'new'), []))} rounds, medians; paired = median of per-round new/old")
    print(f"{'bench':<14}{'groups':>7}{'streams':>8}{'old':>9}{'new':>9}{'new/old':>9}{'paired':>9}")
    for bench in benches:
        old, new = runs.get((bench, "old"), []), runs.get((bench, "new"), [])
        for g in GROUPS:
            for s in COUNTS:
                k = f"g{g}-s{s}"
                if not old or k not in old[0]["tok_s"]:
                    continue
                o, n = statistics.median(x["tok_s"][k] for x in old), statistics.median(x["tok_s"][k] for x in new)
                paired = statistics.median(b["tok_s"][k] / a["tok_s"][k] for a, b in zip(old, new, strict=False))
                table[f"{bench}-{k}"] = {"old": round(o, 2), "new": round(n, 2), "ratio": round(n / o, 3),
                                         "paired": round(paired, 3)}
                mark = " *" if g == DEFAULTS[bench] else ""
                print(f"{bench:<14}{g:>7}{s:>8}{o:>9.1f}{n:>9.1f}{n / o:>9.3f}{paired:>9.3f}{mark}")
                if g == DEFAULTS[bench]:
                    figures[f"ratio_new_vs_old_{bench}_default_groups{g}_s{s}"] = round(n / o, 3)
    print("* the default decode groups of that setting")
    bursts = [b for b in benches if b in BURSTS and runs.get((b, "old"))]
    if bursts:
        print("\nthe same bursts measured three ways (medians over rounds): aggregate = the scripts' figure (tokens "
              "after each stream's first, from the first stream's first token); makespan = every token over submit "
              "-> last token; steady = streams / median step while every stream decodes; first = submit -> first "
              "token, spread = first token of the first stream -> of the last (ms)")
        metrics = ("aggregate", "makespan", "steady", "first_ms", "spread_ms")
        print(f"{'bench':<14}{'streams':>8}" + "".join(f"{m + ' old':>15}{'new':>7}{'n/o':>6}" for m in metrics))
        for bench in bursts:
            old, new = runs[(bench, "old")], runs[(bench, "new")]
            for k in old[0]["burst"]:
                row = f"{bench:<14}{k.split('-s')[1]:>8}"
                for m in metrics:
                    o = statistics.median(x["burst"][k][m] for x in old)
                    n = statistics.median(x["burst"][k][m] for x in new)
                    r = n / o if o else float("nan")
                    table[f"{bench}-{k}-{m}"] = {"old": round(o, 2), "new": round(n, 2), "ratio": round(r, 3)}
                    row += f"{o:>15.1f}{n:>7.1f}{r:>6.2f}"
                    if m in ("makespan", "steady"):
                        figures[f"ratio_new_vs_old_{bench}_{m}_{k.replace('-', '_')}"] = round(r, 3)
                print(row)
    figures |= {"tokens": args.tokens, "reps_per_invocation": args.reps, "quiet_rounds": quiet_rounds,
                "old": str(args.old), "table": table,
                "invocations": {f"{b}-{s}": [{k: v for k, v in x.items() if k != "tok_s"} for x in xs]
                                for (b, s), xs in runs.items()},
                "tok_s": {f"{b}-{s}": [x["tok_s"] for x in xs] for (b, s), xs in runs.items()},
                "burst": {f"{b}-{s}": [x["burst"] for x in xs] for (b, s), xs in runs.items() if b in BURSTS}}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
