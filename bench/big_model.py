"""An 8B-class model split for real: Llama 3.1 8B's shapes as a Q4_K_M GGUF, 1 stage and 4 stages
on 4 processes (a TLS chain on loopback), against llama.cpp alone and over its RPC (issue 22).

The file is random (gguf-py, seeded random K-quant blocks; 32 layers, hidden 4096, 32/8 heads,
FFN 14336, vocabulary 128256, rope_freqs; attn_v and ffn_down Q6_K on llama.cpp's "more bits"
layers, output Q6_K, the rest Q4_K): it measures memory and speed, not answers. Reported:

- export time and peak RSS of each stage process (1 and 4 stages), against each shard;
- decode tok/s and time to first token (a warm server's: each stage repacks its weights at load),
  each in `exact`, `fast` (int8 activations in the compressed matmuls, as llama.cpp's) and `fast`
  on an export re-blocked into groups of 128 (`--reblock 128`: an opt-in that changes the weights,
  the layout the plugin's int8 kernels stream fastest; BENCHMARKS.md, issue 22): shardline
  1 stage, shardline 4 stages (`--balance`d: the head counted as the layers it weighs; stage 0 in
  a coordinator process, stages 1-3 on `shardline worker`s, mutual TLS), llama.cpp alone
  (llama-bench, its defaults: repacked kernels) and llama.cpp RPC (4 ggml-rpc-servers on
  loopback, all layers on them, layer split); each process's peak RSS;
- aggregate decode at 1, 2, 4, 8 streams in one decode group on the 4-process pipeline;
- a verify step of K+1 positions against a one-token step, K = 1..8, on 1 stage;
- the bound of each figure: bytes read per token over the measured memory bandwidth.

    python bench/big_model.py                 # ~1.5 h on 2 cores; needs bench/llama_cpp_tools.sh
    python bench/big_model.py --layers 8      # the same shapes, a quarter of the layers
    python bench/big_model.py --quick --no-llama-cpp   # a tiny file: what CI runs

Each shardline run is its own process (spawned), so each peak RSS is that run's alone. The last
line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ggufs.py builds the file

from kit import Proc, peak_rss_mb  # noqa: E402  (bench/ is on sys.path when this script runs)
from steps import decode_tok_s  # noqa: E402

from shardline.config import ExportConfig, RunConfig, SamplingParams  # noqa: E402
from shardline.model.manifest import load_manifest  # noqa: E402
from tests.gguf_vocab import NORMAL, Vocab, byte_level_vocab  # noqa: E402
from tests.ggufs import FileSpec, write  # noqa: E402

GREEDY = SamplingParams()
# (name, run precision, re-blocked): fast is int8 activations in the compressed matmuls, as llama.cpp's
# are (Q8_K); "re-blocked" is `export --reblock REBLOCK`, an opt-in that changes the weights.
VARIANTS = (("exact", "exact", False), ("fast", "fast", False), ("fast re-blocked", "fast", True))
REBLOCK = 128
TOOLS = Path(__file__).with_name("llama_cpp_tools.sh")


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M gives attn_v and ffn_down Q6_K on these layers (use_more_bits)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def spec(layers: int, quick: bool) -> FileSpec:
    mix = {"*": "Q4_K", "output": "Q6_K"} | {f"{k}:{i}": "Q6_K" for i in range(layers) if more_bits(i, layers)
                                             for k in ("attn_v", "ffn_down")}
    if quick:
        return FileSpec(name="big-quick", mix=mix, layers=layers, hidden=512, heads=8, kv_heads=2, ffn=1024,
                        context=8192, rope_freqs=True, vocab=padded(4096))
    return FileSpec(name="llama31-8b-shaped", mix=mix, layers=layers, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                    context=131072, rope_theta=500000.0, rope_freqs=True, vocab=padded(128256))


def padded(size: int) -> Vocab:
    v = byte_level_vocab()
    extra = size - v.size
    return Vocab(model=v.model, pre=v.pre, tokens=v.tokens + [f"<pad{i}>" for i in range(extra)],
                 types=v.types + [NORMAL] * extra, merges=v.merges, bos=v.bos, eos=v.eos)


def build(args: argparse.Namespace) -> tuple[Path, float]:
    path = args.work / f"{'quick' if args.quick else 'big'}-{args.layers}L.gguf"
    start = time.perf_counter()
    if not path.exists():
        write(spec(args.layers, args.quick), path.with_suffix(".partial"), rng=np.random.default_rng(0))
        path.with_suffix(".partial").rename(path)
    return path, time.perf_counter() - start


def export_stages(model: Path, stages: int, args: argparse.Namespace, reblock: bool = False) -> tuple[Path, float]:
    from shardline.export.exporter import export

    balance = stages > 1  # the head counted as the layers it weighs: the last stage is not the largest
    out = args.work / f"{model.stem}-{stages}stage{'-balanced' if balance else ''}{f'-rb{REBLOCK}' if reblock else ''}"
    start = time.perf_counter()
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export(ExportConfig(out=out, model=model, stages=stages, balance=balance, isolate=True, progress=False,
                            reblock=REBLOCK if reblock else None))
    return out, time.perf_counter() - start


def bandwidth_gb_s(threads: int) -> float:
    """Read bandwidth of this machine: a 1 GiB array read in `threads` slices at once (numpy
    releases the GIL), best of 3 for each of two read kernels (a float sum and an int64 max: on
    a fast core the sum's arithmetic, not memory, can be its limit), the best of all."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(1 << 28, np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for read in (np.sum, lambda x: x.view(np.int64).max()):
            for _ in range(3):
                start = time.perf_counter()
                list(pool.map(read, parts))
                best = min(best, time.perf_counter() - start)
    return a.nbytes / best / 1e9


# --- shardline runs, each in a process of its own -------------------------------------------------

def _timed_stream(pipe: Any, prompt_len: int, tokens: int, key: int = 1) -> tuple[float, float]:
    """(time to first token of a `prompt_len` prompt, decode tok/s over `tokens` steps)."""
    from shardline.pipeline.plan import prefill, run
    from shardline.stage.cache import KVBook

    book = KVBook()
    prompt = [100 + i % 200 for i in range(prompt_len)]
    start = time.perf_counter()
    (out,) = run(pipe, prefill(key, book, prompt, GREEDY, first=True, last=True))
    ttft = time.perf_counter() - start
    tok_s = decode_tok_s(pipe, key, book, out.choices[0].token, tokens, warmup=2)
    pipe.release(key)
    return ttft, tok_s


def _verify_costs(pipe: Any, k_max: int, reps: int = 3) -> dict[int, float]:
    """Median time of a step of K+1 positions (every one sampled, as a verify step) over a
    one-token step's, K = 1..k_max: one stream after a 16-token prompt, the widths taken in
    turn `reps` times (the cache grows by a few slots a step: nothing against 16+ slots)."""
    from shardline.pipeline.plan import decode, prefill, run
    from shardline.stage.cache import KVBook

    book, key = KVBook(), 999
    run(pipe, prefill(key, book, list(range(100, 116)), GREEDY, first=True, last=True))
    times: dict[int, list[float]] = {w: [] for w in range(1, k_max + 2)}
    for _ in range(reps):
        for width in times:
            start = time.perf_counter()
            run(pipe, decode(key, book, list(range(300, 300 + width)), GREEDY, sample_all=width > 1))
            times[width].append(time.perf_counter() - start)
    pipe.release(key)
    one = statistics.median(times[1])
    return {k: statistics.median(times[k + 1]) / one for k in range(1, k_max + 1)}


def _aggregate(pipe: Any, streams: int, tokens: int, context: int) -> float:
    """Decode tok/s of `streams` requests at once through an engine, one decode group."""
    from concurrent.futures import ThreadPoolExecutor

    from shardline.config import SamplingConfig
    from shardline.serving.admission import Limits
    from shardline.serving.engine import Engine
    from shardline.serving.generate import tokens as engine_tokens
    from shardline.serving.scheduler import SchedulerConfig

    engine = Engine(pipe, Limits(streams, streams), context, SchedulerConfig(groups=1))
    try:
        prompts = [[100 + s + i for i in range(16)] for s in range(streams)]
        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            got = list(pool.map(lambda p: engine_tokens(engine, p, SamplingConfig(max_tokens=tokens)), prompts))
        return sum(len(g) for g in got) / (time.perf_counter() - start)
    finally:
        engine.stop()


def one_stage_run(folder: str, precision: str, args: dict[str, Any], out: Any) -> None:
    from shardline.pipeline.local import LocalPipeline

    with LocalPipeline(Path(folder), RunConfig(precision=precision, threads=args["threads"],
                                               context=args["context"])) as pipe:
        ttft, tok_s = _timed_stream(pipe, args["prompt"], args["tokens"])
        verify = _verify_costs(pipe, args["verify_k"])
    out.put({"ttft_s": ttft, "tok_s": tok_s, "verify": verify, "peak_rss_mb": peak_rss_mb()})


def chain_run(folder: str, precision: str, addrs: list[str], creds: str, args: dict[str, Any], out: Any) -> None:
    from shardline.config import default_activations
    from shardline.pipeline.remote import RemotePipeline
    from shardline.wire.tls import Credentials

    run = RunConfig(precision=precision, threads=args["threads"], context=args["context"])
    pipe = RemotePipeline(Path(folder), addrs, run, default_activations(precision),
                          credentials=Credentials.load(Path(creds)))
    try:
        ttft, tok_s = _timed_stream(pipe, args["prompt"], args["tokens"])
        agg = {n: _aggregate(pipe, n, args["tokens"], args["context"]) for n in args["streams"]}
    finally:
        pipe.shutdown()
    out.put({"ttft_s": ttft, "tok_s": tok_s, "aggregate": agg, "peak_rss_mb": peak_rss_mb()})


def in_child(target: Any, *targs: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*targs, q))
    p.start()
    try:
        while True:
            try:
                result: dict[str, Any] = q.get(timeout=5)
                return result
            except queue.Empty:
                if not p.is_alive():
                    raise RuntimeError(f"{target.__name__} ended with exit code {p.exitcode}, no result") from None
    finally:
        p.join(timeout=120)


# --- processes: shardline workers (procs.Proc), llama.cpp's tools ------------------------------------------------

class RpcServer:
    """A llama.cpp ggml-rpc-server on loopback, ready once its port accepts; stopped by its handle."""

    def __init__(self, binary: Path, port: int, threads: int, timeout_s: float = 60) -> None:
        self.proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ggml-rpc-server: nothing listens on port {port}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


def shardline_four(folder: Path, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    return shardline_chain(folder, precision, args, 4)


def shardline_chain(folder: Path, precision: str, args: argparse.Namespace, stages: int) -> dict[str, Any]:
    """Stage 0 in a coordinator process, stages 1.. on `shardline worker`s (mutual TLS, loopback)."""
    from shardline.cluster.keygen import keygen

    creds = args.work / f"credentials-{stages}"
    if not (creds / "ca.pem").exists():
        shutil.rmtree(creds, ignore_errors=True)
        keygen(creds, stages)
    workers = [Proc(["worker", "--shards", str(folder), "--stage", str(i), "--listen", "127.0.0.1:0",
                     "--credentials", str(creds / f"node-{i}"), "--threads", str(args.threads),
                     "--context", str(args.context), "--precision", precision], "listening on ", timeout_s=1800)
               for i in range(1, stages)]
    try:
        addrs = [w.addr for w in workers]
        row = in_child(chain_run, str(folder), precision, addrs, str(creds / "node-0"), child_args(args))
        row["worker_peak_rss_mb"] = [peak_rss_mb(w.proc.pid) for w in workers]
    finally:
        for w in workers:
            w.stop()
    return row


def llama_bench(bin_dir: Path, model: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """llama-bench's prompt and decode speed (its defaults otherwise), and its peak RSS."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(args.prompt), "-n", str(args.tokens),
           "-t", str(args.threads), "-r", str(args.reps), "-o", "json", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench {' '.join(extra)} exited {proc.returncode}")
    rows = json.loads(out)
    pp = next(r for r in rows if r["n_prompt"] > 0)
    tg = next(r for r in rows if r["n_gen"] > 0)
    return {"ttft_s": args.prompt / float(pp["avg_ts"]), "tok_s": float(tg["avg_ts"]),
            "peak_rss_mb": usage.ru_maxrss / 1024}


def llama_rpc(bin_dir: Path, model: Path, args: argparse.Namespace, count: int = 4) -> dict[str, Any]:
    """llama.cpp over its RPC: `count` ggml-rpc-servers on loopback hold every layer, split by layer."""
    servers, ports = [], [50152 + i for i in range(count)]
    try:
        for port in ports:
            servers.append(RpcServer(bin_dir / "ggml-rpc-server", port, args.threads))
        rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
        row = llama_bench(bin_dir, model, args, ["-rpc", rpc, "-ngl", "999", "-sm", "layer"])
        row["server_peak_rss_mb"] = [peak_rss_mb(s.proc.pid) for s in servers]
    finally:
        for s in servers:
            s.stop()
    return row


# --- the run ---------------------------------------------------------------------------------------

def child_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"threads": args.threads, "context": args.context, "prompt": args.prompt, "tokens": args.tokens,
            "verify_k": args.verify_k, "streams": args.streams}


def stage_rows(folder: Path) -> list[dict[str, float]]:
    m = load_manifest(folder)
    return [{"shard_mb": (folder / s.bin).stat().st_size / 2**20, "export_peak_rss_mb": s.export_peak_rss_mb or 0.0,
             "export_base_rss_mb": s.export_base_rss_mb or 0.0} for s in m.stages]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (time to first token)")
    p.add_argument("--reps", type=int, default=2, help="llama-bench repetitions")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048, help="the context every run serves")
    p.add_argument("--verify-k", type=int, default=8)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench-big-model")
    p.add_argument("--quick", action="store_true", help="a tiny file of the same layout (CI)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-rpc", action="store_true", help="llama.cpp alone only")
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.quick:
        args.layers, args.tokens, args.prompt, args.verify_k, args.streams = 4, 8, 16, 4, [1, 2]
        args.work = args.work.with_name(args.work.name + "-quick")
    args.work.mkdir(parents=True, exist_ok=True)
    bin_dir = None
    if not args.no_llama_cpp:
        built = subprocess.run(["bash", str(TOOLS)], capture_output=True, text=True, check=True).stdout
        bin_dir = Path(built.strip().splitlines()[-1])

    model, build_s = build(args)
    file_mb = model.stat().st_size / 2**20
    say = lambda what: print(what, file=sys.stderr, flush=True)  # noqa: E731
    exports, times = {}, {"build_s": build_s}
    for reblocked in (False, True):
        for stages in (1, 4):
            exports[stages, reblocked], times[f"export_{stages}{'_rb' if reblocked else ''}_s"] = export_stages(
                model, stages, args, reblocked)
    say(f"file {file_mb:.0f} MiB; exports {times}")
    gb_s = bandwidth_gb_s(args.threads)
    rows: dict[str, dict[str, Any]] = {}
    for name, precision, reblocked in VARIANTS:
        one, four = exports[1, reblocked], exports[4, reblocked]
        rows[f"shardline 1 stage {name}"] = in_child(one_stage_run, str(one), precision, child_args(args))
        rows[f"shardline 4 processes {name}"] = shardline_four(four, precision, args)
        say(f"shardline {name} done")
    if bin_dir is not None:
        rows["llama.cpp alone"] = llama_bench(bin_dir, model, args, [])
        if not args.no_rpc:
            rows["llama.cpp RPC x4"] = llama_rpc(bin_dir, model, args)
    report(args, model, file_mb, gb_s, rows, times, {k: stage_rows(f) for k, f in exports.items()})
    return 0


def over(rows: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    return rows[a]["tok_s"] / rows[b]["tok_s"] if a in rows and b in rows else None


def slug(name: str) -> str:
    return name.replace(" re-blocked", "_reblocked")


def report(args: argparse.Namespace, model: Path, file_mb: float, gb_s: float, rows: dict[str, dict[str, Any]],
           times: dict[str, float], stages: dict[tuple[int, bool], list[dict[str, float]]]) -> None:
    file_gb = file_mb * 2**20 / 1e9
    size_gb = {rb: sum(r["shard_mb"] for r in stages[1, rb]) * 2**20 / 1e9 for rb in (False, True)}
    print(f"{model.name}: {file_mb:.0f} MiB; memory bandwidth {gb_s:.1f} GB/s ({args.threads} threads): bound "
          f"{gb_s / size_gb[False]:.2f} tok/s for shardline ({size_gb[False]:.2f} GB a token; re-blocked "
          f"{gb_s / size_gb[True]:.2f} at {size_gb[True]:.2f} GB), {gb_s / file_gb:.2f} for llama.cpp "
          f"({file_gb:.2f} GB)")
    for (n, rb), rs in stages.items():
        print(f"export {n} stage(s){' re-blocked' if rb else ''}: "
              f"{times[f'export_{n}' + ('_rb' if rb else '') + '_s']:.0f} s, peak RSS/shard "
              + ", ".join(f"{r['export_peak_rss_mb']:.0f}/{r['shard_mb']:.0f}" for r in rs) + " MB")
    print(f"{'system':<36}{'decode tok/s':>13}{'TTFT s':>9}{'peak RSS MB':>14}")
    for name, r in rows.items():
        extra = r.get("worker_peak_rss_mb") or r.get("server_peak_rss_mb") or []
        print(f"{name:<36}{r['tok_s']:>13.2f}{r['ttft_s']:>9.2f}{r['peak_rss_mb']:>14.0f}"
              + (f"  + {', '.join(f'{x:.0f}' for x in extra)}" if extra else ""))
    figures: dict[str, Any] = {}
    for name, _, rb in VARIANTS:
        one, four = rows[f"shardline 1 stage {name}"], rows[f"shardline 4 processes {name}"]
        print(f"aggregate decode, 4 processes, {name}: "
              + ", ".join(f"{n} streams {v:.2f} tok/s" for n, v in four["aggregate"].items()))
        print(f"verify step / one-token step, 1 stage, {name}: "
              + ", ".join(f"K={k} {v:.2f}" for k, v in one["verify"].items()))
        agg, model_mb = four["aggregate"], size_gb[rb] * 1e9 / 2**20
        v = slug(name)
        figures |= {
            f"one_stage_{v}_over_llama_cpp": over(rows, f"shardline 1 stage {name}", "llama.cpp alone"),
            f"four_over_one_stage_{v}": over(rows, f"shardline 4 processes {name}", f"shardline 1 stage {name}"),
            f"four_{v}_over_llama_rpc": over(rows, f"shardline 4 processes {name}", "llama.cpp RPC x4"),
            f"streams4_over_1_{v}": agg[4] / agg[1] if 4 in agg and 1 in agg else None,
            f"verify5_over_1_{v}": one["verify"].get(4),
            f"worker_rss_over_model_{v}": max(four["worker_peak_rss_mb"]) / model_mb,
            f"one_stage_{v}_over_bound": one["tok_s"] / (gb_s / size_gb[rb]),
        }
    figures |= {
        "llama_cpp_over_bound": (rows["llama.cpp alone"]["tok_s"] / (gb_s / file_gb) if "llama.cpp alone" in rows
                                 else None),
        "tok_s": {k: r["tok_s"] for k, r in rows.items()}, "ttft_s": {k: r["ttft_s"] for k, r in rows.items()},
        "peak_rss_mb": {k: r["peak_rss_mb"] for k, r in rows.items()},
        "worker_peak_rss_mb": {k: r["worker_peak_rss_mb"] for k, r in rows.items() if "worker_peak_rss_mb" in r},
        "aggregate_tok_s": {k: r["aggregate"] for k, r in rows.items() if "aggregate" in r},
        "verify_over_one": {k: r["verify"] for k, r in rows.items() if "verify" in r},
        "exports": {f"{n}{'_rb' if rb else ''}": rs for (n, rb), rs in stages.items()}, "times_s": times,
        "bandwidth_gb_s": gb_s, "file_mb": file_mb, "layers": args.layers, "threads": args.threads,
        "tokens": args.tokens, "prompt": args.prompt, "reblock": REBLOCK, "quick": args.quick,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    raise SystemExit(main())
