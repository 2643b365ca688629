"""Serving at steady load, driven by an outside client (issue 35): GuideLLM, pinned, against
`shardline serve` at its defaults (this tree, and any older commit's tree given) and llama.cpp's
llama-server on the same GGUF, at concurrency 1, 2, 4 and 8, side by side in one run.

Two workloads, each request a streamed /v1/chat/completions with exactly its output length
(GuideLLM sends `ignore_eos`):
- `short`: chats of 128 prompt tokens (GuideLLM's synthetic text, seeded) and 64 output tokens;
- `mixed`: the same chats with every sixth prompt a 2k-token document (prompts cut from
  bench/kit.py's text at rotating offsets, so that no two share a start beyond the template's).

For each system, workload and concurrency: output tok/s (every output token over the run's
duration), TTFT and ITL percentiles, requests completed. Levels run in turn across the systems
(A B C, then C B A for the next round), each server started once, warmed, and kept for the run;
medians over rounds. Every round and level sends prompts of its own (the same to every system):
GuideLLM's synthetic prompts repeat with its seed, and a repeated prompt hits both servers'
prefix caches (a first version of this script measured TTFTs of 50 ms that way). The last line
is one JSON object, ratios first.

    python bench/serving_load.py                                  # this tree vs llama-server, 3 rounds
    python bench/serving_load.py --tree base=/work/wt-6a5d720     # and an older commit (git worktree)
    python bench/serving_load.py --quick                          # smoke: c=1,2, 4 requests, 1 round
    python bench/serving_load.py --workers 2 --workloads short    # over workers (issue 56, point 7)

With `--workers N` each shardline system serves a paged export of N+1 balanced stages (made by
that tree's own code), stage 0 in the server and stages 1..N on `shardline worker`s on loopback,
and llama-server holds every layer on N ggml-rpc-servers (`--rpc`, split by layer), as a new
user would run each over the same machines.

llama-server comes from bench/llama_cpp_tools.sh (built from the llama-cpp-python sdist's
vendored llama.cpp); GuideLLM from `pip install -c constraints.txt guidellm==0.8.1` (the bench
extra). A tree's server runs with PYTHONPATH=<tree>/src and a shard cache of its own (older code
exports older manifest formats), so each commit is measured by its own code.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kit import TEXT, wait_quiet  # bench/ is on sys.path when this script runs

HERE = Path(__file__).resolve().parents[1]
GUIDELLM = Path(sys.executable).parent / "guidellm"
LLAMA_SERVER = Path.home() / ".cache/shardline/llama.cpp/build/bin/llama-server"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
LEVELS = (1, 2, 4, 8)
OUTPUT_TOKENS = 64
SHORT_TOKENS = 128
LONG_TOKENS = 2048
LONG_EVERY = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class System:
    name: str
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    figures: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready in {timeout_s:g} s: see {log}")


@contextmanager
def server(name: str, cmd: list[str], work: Path, env: dict[str, str] | None = None) -> Iterator[System]:
    log = work / f"{name.replace(' ', '_')}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = cmd[cmd.index("--port") + 1]
    system = System(name, f"http://127.0.0.1:{url}", proc)
    try:
        wait_ready(proc, system.url, log)
        yield system
    finally:
        proc.kill()
        proc.wait(timeout=30)


SHARDLINE_MAIN = ["-c", "import sys; from shardline.cli import main; sys.exit(main())"]


@contextmanager
def shardline(name: str, tree: Path, work: Path, extra: list[str], workers: int = 0) -> Iterator[System]:
    """`shardline serve` of `tree` at its defaults (its own export of the default model); with
    `workers`, over that many `shardline worker`s of an export of workers + 1 paged stages."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), SHARDLINE_CACHE=str(work / f"cache-{name}"))
    cmd = [sys.executable, *SHARDLINE_MAIN, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model-id", MODEL, *extra]
    with ExitStack() as stack:
        if workers:
            shards = work / f"cache-{name}" / f"paged-{workers + 1}"
            if not (shards / "manifest.json").exists():
                shards.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, *SHARDLINE_MAIN, "export", "--stages", str(workers + 1), "--balance",
                                "--weights", "gguf", "--paged", "--out", str(shards)], env=env, check=True)
            addrs = [stack.enter_context(shardline_worker(f"{name} worker {k}", shards, k, work, env))
                     for k in range(1, workers + 1)]
            cmd += ["--shards", str(shards), "--workers", ",".join(addrs), "--insecure"]
        yield stack.enter_context(server(name, cmd, work, env))


@contextmanager
def shardline_worker(name: str, shards: Path, stage: int, work: Path, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, *SHARDLINE_MAIN, "worker", "--shards", str(shards), "--stage", str(stage),
           "--listen", f"127.0.0.1:{port}", "--insecure"]
    with listening(name, cmd, port, work, env):
        yield f"127.0.0.1:{port}"


@contextmanager
def listening(name: str, cmd: list[str], port: int, work: Path, env: dict[str, str] | None = None,
              timeout_s: float = 600.0) -> Iterator[None]:
    """A process that serves on `port` once it accepts a connection; killed when the block ends."""
    log = work / f"{name.replace(' ', '_')}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not listening on {port} ({proc.poll()}): see {log}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.3)
        yield
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextmanager
def llama_server(binary: Path, gguf: Path, work: Path, rpc: int = 0) -> Iterator[System]:
    """llama-server on `gguf`; with `rpc`, every layer on that many ggml-rpc-servers (loopback)."""
    # --no-repack: llama.cpp's repacked (AMX) CPU buffers die with SIGILL/SIGSEGV on these VMs.
    # 8 slots of 4096 tokens: every level runs at once, a 2k prompt fits a slot.
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(free_port()), "-t", "2",
           "--parallel", str(max(LEVELS)), "-c", str(max(LEVELS) * 4096), "--no-webui", "--no-repack",
           "--alias", MODEL]
    with ExitStack() as stack:
        if rpc:
            ports = [free_port() for _ in range(rpc)]
            for i, port in enumerate(ports):
                stack.enter_context(listening(f"rpc-server {i}", [str(binary.parent / "ggml-rpc-server"), "-H",
                                                                  "127.0.0.1", "-p", str(port), "-t", "2"], port, work))
            cmd += ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-ngl", "999", "-sm", "layer"]
        yield stack.enter_context(server(f"llama-server rpc x{rpc}" if rpc else "llama-server", cmd, work))


def mixed_dataset(tokenizer_dir: Path, n: int, path: Path, tag: int) -> Path:
    """`n` prompts, every LONG_EVERY-th LONG_TOKENS long and the rest SHORT_TOKENS, each starting at
    its own place in TEXT (the tokens of TEXT repeated, rotated) after its own tag, as GuideLLM's
    JSON rows."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    rows = []
    for i in range(n):
        size = LONG_TOKENS if i % LONG_EVERY == 2 else SHORT_TOKENS
        start = (i * 53) % len(ids)
        rotated = ids[start:] + ids[:start]
        cut = (rotated * (size // len(rotated) + 1))[:size]
        rows.append({"prompt": f"Request {tag}-{i}. " + tok.decode(cut), "output_tokens_count": OUTPUT_TOKENS})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def guidellm(system: System, data: str, seed: int, streams: int, requests: int, tokenizer_dir: Path,
             out: Path) -> dict[str, float]:
    """One GuideLLM benchmark: `requests` streamed chats at `streams` at once; its figures."""
    cmd = [str(GUIDELLM), "run",
           "--backend", f"kind=openai_http,target={system.url},request_format=/v1/chat/completions,model={MODEL}",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
           "--data", data, "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm against {system.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = m["request_totals"]["successful"]
    tokens = m["output_token_count"]["successful"]["total_sum"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = m["inter_token_latency_ms"]["successful"]["percentiles"]
    return {"out_tok_s": tokens / bench["duration"], "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"],
            "ttft_p99_ms": ttft["p99"], "itl_p50_ms": itl["p50"], "itl_p90_ms": itl["p90"], "itl_p99_ms": itl["p99"],
            "completed": ok, "errored": m["request_totals"]["errored"]}


def warm(system: System) -> None:
    """A few requests first: compiled graphs, caches and the servers' first-use costs paid."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}
    for _ in range(3):
        httpx.post(f"{system.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def report(systems: list[System], workloads: list[str], levels: tuple[int, ...]) -> dict[str, Any]:
    cols = ["out_tok_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms",
            "completed", "errored"]
    figures: dict[str, Any] = {}
    for w in workloads:
        print(f"\n{w}: medians over rounds")
        print(f"{'system':<16}{'c':>3}" + "".join(f"{c:>13}" for c in cols))
        for s in systems:
            for c in levels:
                med = median_of(s.figures[(w, c)])
                figures[f"{w}/{s.name}/c{c}"] = {k: round(v, 2) for k, v in med.items()}
                print(f"{s.name:<16}{c:>3}" + "".join(f"{med[k]:>13.1f}" for k in cols))
    ratios: dict[str, float] = {}
    main = systems[0].name
    for w in workloads:
        for c in levels:
            me = figures[f"{w}/{main}/c{c}"]
            for other in systems[1:]:
                them = figures[f"{w}/{other.name}/c{c}"]
                tag = other.name.replace(" ", "_").replace("-", "_")
                ratios[f"{w}_c{c}_tok_s_vs_{tag}"] = round(me["out_tok_s"] / them["out_tok_s"], 3)
                ratios[f"{w}_c{c}_ttft_p50_vs_{tag}"] = round(me["ttft_p50_ms"] / them["ttft_p50_ms"], 3)
            if c > 1 and f"{w}/{main}/c1" in figures:
                ratios[f"{w}_c{c}_vs_c1_tok_s"] = round(me["out_tok_s"] / figures[f"{w}/{main}/c1"]["out_tok_s"], 3)
    print("\nratios (" + main + " over the others)")
    for k, v in ratios.items():
        print(f"  {k:<48}{v:>8.3f}")
    return {"ratios": ratios, "figures": figures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke: c=1,2, 4 requests, one round, short chats")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=24, help="requests per level (GuideLLM's max_requests)")
    p.add_argument("--workloads", default="short,mixed")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="another shardline tree (a git worktree of an older commit) served the same way")
    p.add_argument("--serve-args", default="", help="extra flags for this tree's `shardline serve`")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="this tree served again with these flags (e.g. 'nocache=--prefix-cache-mb 0')")
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-serving-load")
    p.add_argument("--workers", type=int, default=0,
                   help="stages 1..N on shardline workers, and llama-server's layers on N ggml-rpc-servers")
    args = p.parse_args()
    levels = (1, 2) if args.quick else tuple(int(c) for c in args.levels.split(","))
    rounds, requests = (1, 4) if args.quick else (args.rounds, args.requests)
    workloads = ["short"] if args.quick else args.workloads.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    if not GUIDELLM.exists():
        print(f"no GuideLLM at {GUIDELLM}: pip install -c constraints.txt guidellm==0.8.1", file=sys.stderr)
        return 2
    quiet, load = wait_quiet(max_wait_s=60 if args.quick else 1200)
    from shardline.model.source import default_model_path

    with ExitStack() as stack:
        w = args.workers
        systems = [stack.enter_context(shardline("shardline", HERE, args.work, args.serve_args.split(), w))]
        for spec in args.variant:
            name, _, flags = spec.partition("=")
            systems.append(stack.enter_context(shardline(f"shardline {name}", HERE, args.work, flags.split(), w)))
        for spec in args.tree:
            name, _, tree = spec.partition("=")
            systems.append(stack.enter_context(shardline(f"shardline {name}", Path(tree), args.work, [], w)))
        if not args.no_llama_server:
            if not args.llama_server.exists():
                print(f"no llama-server at {args.llama_server} (bash bench/llama_cpp_tools.sh): left out",
                      file=sys.stderr)
            else:
                systems.append(stack.enter_context(llama_server(args.llama_server, default_model_path(), args.work,
                                                                args.workers)))
        tokenizer_dir = next((args.work / "cache-shardline").glob("*/tokenizer.json")).parent

        def data(workload: str, tag: int) -> str:
            if workload == "short":
                return f"kind=synthetic_text,prompt_tokens={SHORT_TOKENS},output_tokens={OUTPUT_TOKENS}"
            rows = mixed_dataset(tokenizer_dir, max(requests, 2 * LONG_EVERY), args.work / f"mixed-{tag}.jsonl", tag)
            return f"kind=json_file,path={rows}"
        for s in systems:
            warm(s)
        started = time.time()
        for r in range(rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            for w in workloads:
                for c in levels:
                    # prompts of their own at each round and level (the same for every system):
                    # a prompt seen before would hit the servers' prefix caches (both keep prompts)
                    tag = 1000 * r + c
                    for s in order:
                        out = args.work / f"r{r}-{w}-c{c}-{s.name.replace(' ', '_')}.json"
                        out.unlink(missing_ok=True)
                        fig = guidellm(s, data(w, tag), tag, c, requests, tokenizer_dir, out)
                        s.figures.setdefault((w, c), []).append(fig)
                        print(f"round {r} {w} c={c} {s.name}: {fig['out_tok_s']:.1f} tok/s, "
                              f"TTFT p50 {fig['ttft_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
        result = report(systems, workloads, levels)
    result.update(rounds=rounds, requests=requests, workers=args.workers, quiet_at_start=quiet,
                  load_at_start=round(load, 2),
                  minutes=round((time.time() - started) / 60, 1),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
