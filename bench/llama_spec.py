"""llama.cpp's own speculative decoding beside shardline's (bench/speculative.py --llama-server):
llama-server on the target alone, then with the draft model (`-md`, its defaults otherwise), the
same prompt token ids, greedy, one request at a time; its own timings (decode tok/s after the
first token, drafts offered and accepted)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx  # what the openai client itself uses here

START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(binary: Path, target: Path, draft: Path | None, threads: int, log: Path) -> Iterator[str]:
    """A llama-server on loopback (its URL), stopped by its handle."""
    port = _free_port()
    # --no-repack: llama-server's weight repacking (the CPU's extra buffer types) dies of SIGILL at
    # load on this machine (2026-12-06, Xeon with AVX512 and AMX), as llama-cpp-python does without
    # use_extra_bufts=False (MISSION.md); llama-bench's repacked path runs. Its tok/s is then without
    # the repacked kernels, on both of its sides (plain and -md).
    cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "--parallel", "1", "-c", "4096", "--temp", "0", "--no-webui", "--no-repack"]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: see {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _complete(url: str, prompt: list[int], n: int) -> dict[str, Any]:
    r = httpx.post(f"{url}/completion", timeout=REQUEST_TIMEOUT_S, json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": False})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def measure(binary: Path, target: Path, draft: Path, prompts: dict[str, list[int]], n: int, rounds: int,
            threads: int, work: Path) -> dict[str, Any]:
    """Per prompt type: plain tok/s, speculative tok/s, the speedup (median of per-round ratios),
    acceptance and tokens per verify step; and their means over the types."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {"plain": [], "spec": []} for t in prompts}
    # Both servers up at once (an idle one takes no core), requests alternating between them.
    with llama_server(binary, target, None, threads, work / "llama-server-plain.log") as plain_url, \
            llama_server(binary, target, draft, threads, work / "llama-server-spec.log") as spec_url:
        urls = {"plain": plain_url, "spec": spec_url}
        for url in urls.values():
            for t in list(prompts)[:2]:  # warm-up
                _complete(url, prompts[t], 16)
        for r in range(rounds):
            for t, prompt in prompts.items():
                for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    runs[t][name].append(_complete(urls[name], prompt, n))
    out: dict[str, Any] = {"types": {}}
    for t, by in runs.items():
        plain = [r["timings"]["predicted_per_second"] for r in by["plain"]]
        spec = [r["timings"]["predicted_per_second"] for r in by["spec"]]
        drafted = sum(r["timings"].get("draft_n", 0) for r in by["spec"])
        accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in by["spec"])
        out["types"][t] = {
            "plain_tok_s": statistics.median(plain), "spec_tok_s": statistics.median(spec),
            "speedup": statistics.median(s / p for s, p in zip(spec, plain, strict=True)),
            "acceptance": accepted / drafted if drafted else 0.0,
            "same": sum(a["content"] == b["content"] for a, b in zip(by["plain"], by["spec"], strict=True)),
            "runs": rounds}
    ups = [row["speedup"] for row in out["types"].values()]
    out["mean_speedup"] = statistics.fmean(ups)
    return out
