"""Prefix reuse (issue 26): what a chat's later turns and requests sharing a system prompt cost,
shardline with its prefix cache on and off (in process, and with stages 1-2 on two workers)
against llama.cpp's own llama-server, side by side in one run, each driven over HTTP by the
official `openai` client as a chat client drives it.

- chat: 6 turns over a ~1,050-token system prompt, each turn the whole conversation so far
  (streamed, 64 tokens per answer, greedy); time to first token per turn.
- shared: 8 requests at once, one ~1,050-token system prompt (another one) and a different
  question each (streamed, 32 tokens); time to first token per request.
Tokens prefilled: shardline's /metrics (prompt tokens less those a kept prefix saved);
llama-server's own `timings.prompt_n` (the prompt tokens it evaluated).

Every round starts each system prompt with the round's number, so nothing is reused across
rounds; medians over rounds. llama-server is built from the llama.cpp sources the
llama-cpp-python sdist vendors (bench/llama_cpp_tools.sh), `--parallel 8`, 2 threads.

    python bench/prefix.py --quick
    python bench/prefix.py [--llama-server PATH] [--rounds 3]
    python bench/prefix.py --disaggregate   # instead: serve --disaggregate 1:1, cache off and on
    python bench/prefix.py --paged          # instead: the paged export against the stateful one, in process

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import openai
from kit import TEXT, Proc, shard_folder, wait_quiet, worker

QUESTIONS = ["What is the main point of the text above?", "Which invention made the ride more comfortable?",
             "Why did bicycles become popular with workers?", "How are electric bicycles different?",
             "Name two things cities build for cyclists.", "Summarise the history in one sentence.",
             "What did clubs do?", "Which engineering lessons went to cars and aeroplanes?"]
TURNS, ANSWER, SHARED_ANSWER = 6, 64, 32
MODEL = "bench"


def system_prompt(round_: int, variant: int) -> str:
    """~1,050 tokens: the text three times (each time its paragraphs in another order)."""
    paragraphs = TEXT.split("\n\n")
    turns = [paragraphs[i:] + paragraphs[:i] for i in range(3)]
    body = "\n\n".join(p for t in (turns if variant == 0 else turns[::-1]) for p in t)
    return f"Session {round_}-{variant}. Answer questions about this text.\n\n{body}"


@dataclass
class Asked:
    ttft: float
    prefilled: float | None  # prompt tokens the server evaluated (None: it does not say)
    text: str = ""


@dataclass
class System:
    name: str
    url: str  # .../v1
    procs: list[Proc | subprocess.Popen] = field(default_factory=list)
    chat: list[list[Asked]] = field(default_factory=list)  # per round, per turn
    shared: list[list[Asked]] = field(default_factory=list)  # per round, per request

    def metric(self, name: str) -> float:
        text = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    @property
    def shardline(self) -> bool:
        return not self.name.startswith("llama")

    def prefilled_since(self, before: tuple[float, float]) -> float:
        prompt, saved = self.counters()
        return (prompt - before[0]) - (saved - before[1])

    def counters(self) -> tuple[float, float]:
        return (self.metric("shardline_prompt_tokens_total"), self.metric("shardline_prefix_cache_tokens_saved_total"))


def ask(system: System, messages: list[dict[str, str]], max_tokens: int) -> Asked:
    """One streamed chat completion: time to first content, the text, llama-server's prompt_n."""
    client = openai.OpenAI(base_url=system.url, api_key="bench", max_retries=0, timeout=600)
    start, first, text, prompt_n = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                            temperature=0, stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta and first is None:
            first = time.perf_counter()
        text.append(delta or "")
        timings = (chunk.model_extra or {}).get("timings")
        if timings:
            prompt_n = timings.get("prompt_n")
    return Asked((first or time.perf_counter()) - start, prompt_n, "".join(text))


def run_chat(system: System, round_: int) -> list[Asked]:
    messages = [{"role": "system", "content": system_prompt(round_, 0)}]
    out = []
    for q in QUESTIONS[:TURNS]:
        messages.append({"role": "user", "content": q})
        before = system.counters() if system.shardline else (0.0, 0.0)
        got = ask(system, messages, ANSWER)
        if system.shardline:
            got.prefilled = system.prefilled_since(before)
        messages.append({"role": "assistant", "content": got.text})
        out.append(got)
    return out


def run_shared(system: System, round_: int) -> list[Asked]:
    prompt = system_prompt(round_, 1)
    before = system.counters() if system.shardline else (0.0, 0.0)
    got: list[Asked | None] = [None] * len(QUESTIONS)

    def one(i: int) -> None:
        got[i] = ask(system, [{"role": "system", "content": prompt}, {"role": "user", "content": QUESTIONS[i]}],
                     SHARED_ANSWER)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    done = [g for g in got if g is not None]
    if system.shardline and done:
        done[0].prefilled = system.prefilled_since(before)  # the total, on the first
        for g in done[1:]:
            g.prefilled = 0.0
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(binary: Path, gguf: Path, log: Path) -> Iterator[System]:
    port = free_port()
    # --no-repack: llama.cpp's repacked (AMX) CPU buffers die with SIGILL/SIGSEGV on these VMs
    # (MISSION.md: llama-cpp-python needs use_extra_bufts=False for the same reason).
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                                 "--parallel", "8", "-c", str(8 * 4096), "--temp", "0", "--no-webui", "--no-repack"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not start")
        yield System("llama-server", f"http://127.0.0.1:{port}/v1", [proc])
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextmanager
def shardline(name: str, folder: Path, cache_mb: int, workers: list[Proc] | None = None,
              extra: tuple[str, ...] = ()) -> Iterator[System]:
    args = ["serve", "--shards", str(folder), "--port", "0", "--model-id", MODEL, "--max-streams", "8",
            "--prefix-cache-mb", str(cache_mb), *extra]
    if workers:
        args += ["--workers", ",".join(w.addr for w in workers), "--insecure"]
    server = Proc(args, "serving ", stream="stderr", timeout_s=600)
    try:
        yield System(name, server.url, [server])
    finally:
        server.stop()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, no llama-server unless given")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-server", type=Path, help="the llama-server binary (default: bench/llama_cpp_tools.sh's)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    p.add_argument("--paged", action="store_true",
                   help="instead: the paged export (issue 41: kept prefixes shared by block) against the stateful "
                        "one (prefixes copied), cache off and on, in process")
    p.add_argument("--disaggregate", action="store_true",
                   help="instead: shardline --disaggregate 1:1 (a prefill and a decode instance), cache off and on")
    args = p.parse_args()
    from shardline.model.source import default_model_path

    rounds = 1 if args.quick else args.rounds
    binary = args.llama_server or Path.home() / ".cache/shardline/llama.cpp/build/bin/llama-server"
    has_llama = binary.is_file()
    if not has_llama:
        print(f"no llama-server at {binary} (bash bench/llama_cpp_tools.sh builds it): left out", file=sys.stderr)
    quiet, load = wait_quiet()
    two, three = shard_folder(args.work, 2, balance=True), shard_folder(args.work, 3)
    systems: dict[str, System] = {}

    def measure(make: object) -> None:
        with make as system:  # type: ignore[attr-defined]
            ask(system, [{"role": "user", "content": "Hello"}], 4)  # warm: graphs compiled
            for r in range(rounds):
                system.chat.append(run_chat(system, r))
                system.shared.append(run_shared(system, r))
                print(f"  round {r + 1}: {system.name}: chat ttft "
                      f"{' '.join(f'{a.ttft:.2f}' for a in system.chat[-1])} s", file=sys.stderr, flush=True)
            systems[system.name] = system

    if args.paged:
        paged = shard_folder(args.work, 2, balance=True, paged=True)
        measure(shardline("shardline, cache off", two, 0))
        measure(shardline("shardline", two, 512))
        measure(shardline("shardline paged, cache off", paged, 0))
        measure(shardline("shardline paged", paged, 512))
        return report(systems, rounds, quiet, load)
    if args.disaggregate:
        split = ("--disaggregate", "1:1")
        measure(shardline("shardline 1:1, cache off", two, 0, extra=split))
        measure(shardline("shardline 1:1", two, 512, extra=split))
        return report(systems, rounds, quiet, load)
    if has_llama:
        measure(llama_server(binary, default_model_path(), args.work / "llama-server.log"))
    measure(shardline("shardline, cache off", two, 0))
    measure(shardline("shardline", two, 512))
    ws = [worker(three, 1), worker(three, 2)]
    try:
        measure(shardline("shardline 2 workers, cache off", three, 0, ws))
        measure(shardline("shardline 2 workers", three, 512, ws))
    finally:
        for w in ws:
            w.stop()
    return report(systems, rounds, quiet, load)


def report(systems: dict[str, System], rounds: int, quiet: bool, load: float) -> int:
    print(f"\nload {load:.2f} at start ({'quiet' if quiet else 'NOT quiet'}); medians of {rounds} rounds")
    print(f"{'system':>32}  " + " ".join(f"{'turn ' + str(t + 1):>7}" for t in range(TURNS))
          + f"  {'later':>6}  {'shared':>7}")
    figures: dict[str, float] = {}
    later: dict[str, float] = {}
    for name, s in systems.items():
        turns = [median([c[t].ttft for c in s.chat]) for t in range(TURNS)]
        later[name] = median(turns[1:])
        shared = median([a.ttft for r in s.shared for a in r])
        print(f"{name:>32}  " + " ".join(f"{x:7.2f}" for x in turns) + f"  {later[name]:6.2f}  {shared:7.2f}")
        prefilled = [median([c[t].prefilled or 0.0 for c in s.chat]) for t in range(TURNS)]
        print(f"{'tokens prefilled':>32}  " + " ".join(f"{x:7.0f}" for x in prefilled)
              + f"  {'':6}  {median([sum(a.prefilled or 0.0 for a in r) for r in s.shared]):7.0f}")
        figures[f"{name} later turn ttft s"] = round(later[name], 3)
        figures[f"{name} shared ttft s"] = round(shared, 3)
    ratios = {}
    if "shardline paged" in later:
        ratios["ratio_later_turn_ttft_paged_vs_copied"] = round(later["shardline paged"] / later["shardline"], 3)
        ratios["ratio_later_turn_ttft_paged_vs_cache_off"] = round(
            later["shardline paged"] / later["shardline paged, cache off"], 3)
        ratios["ratio_later_turn_ttft_vs_cache_off"] = round(later["shardline"] / later["shardline, cache off"], 3)
    elif "shardline 1:1" in later:
        ratios["ratio_later_turn_ttft_1to1_vs_cache_off"] = round(
            later["shardline 1:1"] / later["shardline 1:1, cache off"], 3)
    else:
        if "llama-server" in later:
            ratios["ratio_later_turn_ttft_vs_llama_server"] = round(later["shardline"] / later["llama-server"], 3)
            ratios["ratio_later_turn_ttft_2workers_vs_llama_server"] = round(
                later["shardline 2 workers"] / later["llama-server"], 3)
        ratios["ratio_later_turn_ttft_vs_cache_off"] = round(later["shardline"] / later["shardline, cache off"], 3)
        ratios["ratio_later_turn_ttft_2workers_vs_cache_off"] = round(
            later["shardline 2 workers"] / later["shardline 2 workers, cache off"], 3)
    print(json.dumps(ratios | figures | {"rounds": rounds, "quiet": quiet, "load_at_start": round(load, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
