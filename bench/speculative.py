"""Speculative decoding (issue 10): speedup over plain decoding and acceptance, per prompt type and
per draft source, in process and on 2 worker processes at several delays per hop; the full stack
against a naive pipeline; sampled drafts' acceptance and the bytes of q's support per step.

Draft sources (`--sources`, comma-separated):
  ngram     prompt lookup (n-gram matches in the prompt and the text so far; no model)
  int8      the target model itself exported with int8 weights as one stage (a compressed copy:
            no smaller model sharing SmolLM2's tokenizer is available offline)
  int4      the same with int4 weights
  layers:L  self-speculation: the target's first L of 30 layers, its final norm and head
  PATH      any one-stage export folder sharing the target's tokenizer
K is auto (`--k auto`, chosen per stream from its measured acceptance and step cost, at most
`--k-max`) unless a number is given.

(1) speculation: each prompt type through plain decoding (an engine without speculation) and
    through an engine per draft source, one request at a time, greedy, in process (the default
    2-stage balanced gguf export, every stage on its own thread) and on 2 worker processes (a
    3-stage export: stage 0 and the drafter in this process, stages 1 and 2 on one worker each,
    a daisy chain) with `shardline relay` on every hop (coordinator -> worker 1, worker 1 ->
    worker 2, and worker 2's answer back: 3 delays per step) at each of `--delays` ms. Tok/s
    of generation excluding prefill (first token to last); speedup = the median over rounds of
    spec tok/s / plain tok/s in the same round (the systems run one after the other on each
    type, their order alternating per round). Acceptance = drafts that stood / drafts offered;
    K = drafts offered per verify step (SpecStats: drafted / steps).
(2) the full stack against a naive pipeline, on the same 2 workers with the relay capped at
    `--rate-mbit` per direction, at each delay: naive = one stream, no speculation, the full
    logits row of every token returned (`want_logits`); full = `--streams` streams at once in
    decode groups (the serve default: one group per stage), speculating with `--stack-source`
    (default: the source with the best mean speedup at the highest delay measured in (1)),
    top-1 returned. Also, to split the gain: one stream top-1 without speculation, and the
    streams in groups without speculation. Several streams' figure: aggregate tok/s = tokens
    after each stream's first / (last stream's last token - first stream's first token), which
    the slowest stream of the burst sets; also the sum of each stream's own tok/s.
(3) sampled drafts (temperature `--temperature`, in process, the model sources, K fixed at
    `--sampled-k`: in process a draft model costs what the target does and auto K offers almost
    no drafts, which would leave nothing to measure): acceptance, K and speedup, and the bytes
    of q's support a verify step carries (per drafted position SUPPORT = 16 ids as i64 + 16
    probabilities as f32 = 192 B; as the step builds it, every sampled position of a row, K + 1,
    carries a token i64 + the padded support: 200 B each).

Stop tokens are honoured by default (`--ignore-stops` to generate exactly `--tokens`): speculation
is exact under greedy decoding, so plain and speculative runs generate the same tokens (checked:
"same"), and their tok/s compare. At delays >= `--far-from` ms runs generate `--far-tokens`
tokens with `--far-rounds` rounds (a plain token costs 3 trips there).

    python bench/speculative.py --quick
    python bench/speculative.py                          # everything (~45-60 min on 2 cores)
    python bench/speculative.py --parts spec --delays 0,100 --types chat,code --sources ngram,layers:8

The last line on stdout is one JSON object with the figures, ratios first.
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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import Proc  # bench/ is on sys.path when this script runs
from shards import shard_folder

from shardline.config import RunConfig, SamplingConfig, ServeConfig, SpeculationConfig
from shardline.decoding.drafts import SUPPORT
from shardline.model.manifest import EXPORT_TAG
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_engine
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.speculation import SpecStats

PROMPTS = {
    "chat": "Hi! I'm planning a weekend trip to the mountains with two friends. What should we pack, and what "
            "should we be careful about?",
    "code": "Complete this Python function and explain it briefly:\n\n```python\ndef merge_sorted(a: list[int], "
            "b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    result = "
            "[]\n    i = j = 0\n",
    "reasoning": "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many as he has left. How many "
                 "sheep does he have now? Think step by step.",
    "list": "List ten everyday uses of baking soda, one per line, with a short explanation for each.",
    "creative": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "technical": "Explain how HTTPS protects data between a browser and a web server, including the TLS handshake.",
    "translation": "Translate into French: The weather was cold this morning, so I took my warm coat and walked to "
                   "the station. The train was late, and I read a book while I waited.",
    "rewrite": "Summarize the following text in three sentences:\n\nThe city council met on Tuesday to discuss the "
               "new public library. The library will be built near the central park and will include a children's "
               "reading room, a computer lab and a cafe. Construction will start in the spring and is expected to "
               "take two years. The council said the project will cost twelve million dollars, paid for by a state "
               "grant and local taxes. Some residents worried about traffic near the park, and the council promised "
               "a study of parking and bus routes before construction begins.",
}
REQUEST_TIMEOUT_S = 600.0
Q_SUPPORT_BYTES = SUPPORT * (8 + 4)  # per drafted position: ids i64 + probabilities f32
Q_ENTRY_BYTES = 8 + Q_SUPPORT_BYTES  # per sampled position of a verify step: + the draft token (i64)


# --- subprocesses ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_relay(to: str, delay_ms: float, rate_mbit: float | None, timeout_s: float = 20.0) -> tuple[Proc, str]:
    port = free_port()
    args = ["relay", "--listen", f"127.0.0.1:{port}", "--to", to, "--delay-ms", str(delay_ms)]
    proc = Proc(args + (["--rate-mbit", str(rate_mbit)] if rate_mbit else []), "relaying")
    deadline = time.monotonic() + timeout_s  # it prints before it binds: wait until it accepts
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"relay to {to} never accepted on port {port}")


@contextmanager
def relays(workers: list[str], delay_ms: float, rate_mbit: float | None) -> Iterator[list[str]]:
    """A relay in front of every worker: the coordinator reaches worker 1 through the first, worker
    1 reaches worker 2 (its Route) through the second, and worker 2 answers the coordinator through
    the second too: 3 delays per step."""
    procs: list[Proc] = []
    try:
        via = []
        for w in workers:
            proc, addr = start_relay(w, delay_ms, rate_mbit)
            procs.append(proc)
            via.append(addr)
        yield via
    finally:
        for p in procs:
            p.stop()


class LoadWatch:
    """Samples the load average and whether a pytest runs, every `every_s`, while the run lasts: a
    figure measured while other jobs ran on this 2-core machine says so."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.loads: list[float] = []
        self.pytest: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every_s,), daemon=True)
        self._thread.start()

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.loads.append(os.getloadavg()[0])
            self.pytest.append(subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"load_median": round(med(self.loads), 2), "load_max": round(max(self.loads, default=float("nan")), 2),
                "pytest_share": round(sum(self.pytest) / len(self.pytest), 2) if self.pytest else 0.0,
                "samples": len(self.loads)}


def git_state() -> dict[str, Any]:
    """The commit measured, and whether src/ had uncommitted changes (another engineer's work)."""
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "src_dirty": bool(git("status", "--short", "src"))}


# --- engines and requests ------------------------------------------------------------------------


def draft_path(source: str, work: Path) -> str:
    """A --sources entry as SpeculationConfig.draft: "ngram", or an export folder."""
    if source == "ngram":
        return "ngram"
    if source in ("int8", "int4"):
        from shardline.config import ExportConfig
        from shardline.export.exporter import export

        folder = work / f"smollm2-135m-{source}-1stage-{EXPORT_TAG}"
        if not (folder / "manifest.json").is_file():
            print(f"exporting {folder} ...", file=sys.stderr)
            export(ExportConfig(out=folder, stages=1, weights=source, isolate=False, progress=False))
        return str(folder)
    if source.startswith("layers:"):
        from shardline.export.defaults import self_draft_shards

        return str(self_draft_shards(int(source[7:]), progress=False))
    if not (Path(source) / "manifest.json").is_file():
        raise SystemExit(f"unknown draft source {source!r} (ngram, int8, int4, layers:L or an export folder)")
    return source


class Engines:
    """Named engines over one placement (every stage here, or the given workers); all stopped on
    close, each guarded."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}

    def open(self, name: str, folder: Path, workers: list[str] | None, spec: SpeculationConfig,
             groups: int | None = None) -> Engine:
        engine, _ = open_engine(folder, RunConfig(), ServeConfig(decode_groups=groups), workers, "f16", spec=spec)
        self.engines[name] = engine
        return engine

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    def close(self) -> None:
        for name, engine in self.engines.items():
            try:
                engine.stop()
                engine.pipe.shutdown()
            except Exception as e:  # noqa: BLE001 - the others must still be closed
                print(f"closing {name}: {type(e).__name__}: {e}", file=sys.stderr)
        self.engines = {}


@contextmanager
def engines() -> Iterator[Engines]:
    e = Engines()
    try:
        yield e
    finally:
        e.close()


@dataclass
class Run:
    """One request: its tokens and their arrival times."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    submitted: float = 0.0
    finish: str = ""
    error: str = ""
    spec: SpecStats | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, ev: Event) -> None:
        if ev.token is not None:
            self.tokens.append(ev.token)
            self.times.append(time.perf_counter())
        if ev.finish:
            self.finish, self.error, self.spec = ev.finish, ev.error, ev.spec
            self.done.set()

    @property
    def decode_s(self) -> float:
        return self.times[-1] - self.times[0] if len(self.times) > 1 else float("nan")

    @property
    def tok_s(self) -> float:
        """Generation excluding prefill: tokens after the first over first -> last token."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 else float("nan")


def run_all(engine: Engine, requests: list[Request]) -> list[Run]:
    """Submit every request at once; wait (bounded) until all have ended."""
    runs = [Run() for _ in requests]
    tickets = []
    try:
        for req, run in zip(requests, runs, strict=True):
            run.submitted = time.perf_counter()
            tickets.append(engine.submit(req, run))
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        for run in runs:
            if not run.done.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"a request did not end within {REQUEST_TIMEOUT_S:g} s")
    finally:
        for t in tickets:
            engine.cancel(t)  # a no-op for a request that has ended
    for run in runs:
        if run.finish not in ("stop", "length"):
            raise RuntimeError(f"request ended with {run.finish}: {run.error}")
    return runs


def aggregate_tok_s(runs: list[Run]) -> float:
    """Several streams: tokens after each stream's first over the first token -> the last token."""
    start = min(r.times[0] for r in runs)
    end = max(r.times[-1] for r in runs)
    return sum(len(r.tokens) - 1 for r in runs) / (end - start)


def spec_totals(runs: list[Run]) -> dict[str, float]:
    """Acceptance and mean K over every speculating run given."""
    stats = [r.spec for r in runs if r.spec is not None]
    drafted, accepted, steps = (sum(s.drafted for s in stats), sum(s.accepted for s in stats),
                                sum(s.steps for s in stats))
    return {"acceptance": accepted / drafted if drafted else 0.0, "k_mean": drafted / steps if steps else 0.0,
            "tokens_per_step": sum(len(r.tokens) - 1 for r in runs) / steps if steps else 0.0,
            "drafted": drafted, "accepted": accepted, "steps": steps}


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


# --- (1) speculation per type and source ---------------------------------------------------------


def measure_spec(eng: Engines, systems: list[str], prompts: dict[str, list[int]], n: int, rounds: int,
                 stops: frozenset[int], label: str, deadline: float, sampling: dict[str, Any] | None = None
                 ) -> dict[str, dict[str, list[Run]]]:
    """runs[type][system]: one request at a time, the systems in turn on each type (order
    alternating per round). System "plain" is the engine without speculation."""
    extra = sampling or {}
    for name in systems:  # warm-up: first calls, verify widths, the step-cost estimate
        for t in list(prompts)[:2]:
            run_all(eng[name], [Request(prompts[t], SamplingConfig(max_tokens=min(n, 16), **extra), stops)])
    runs: dict[str, dict[str, list[Run]]] = {t: {s: [] for s in systems} for t in prompts}
    for r in range(rounds):
        if r and time.monotonic() > deadline:
            print(f"  {label}: time box, stopping after {r} rounds", file=sys.stderr)
            break
        order = systems if r % 2 == 0 else systems[::-1]
        for i, (t, prompt) in enumerate(prompts.items()):
            seed = {"seed": 1000 * r + i} if extra else {}
            for name in order:
                (x,) = run_all(eng[name], [Request(prompt, SamplingConfig(max_tokens=n, **extra, **seed), stops)])
                runs[t][name].append(x)
            plain = runs[t]["plain"][-1].tok_s
            print(f"  {label} round {r + 1}/{rounds} {t}: plain {plain:.1f} tok/s ({len(runs[t]['plain'][-1].tokens)} "
                  "tokens); " + ", ".join(f"{s} {runs[t][s][-1].tok_s / plain:.2f}x" for s in systems if s != "plain"),
                  file=sys.stderr, flush=True)
    return runs


def summarize_spec(runs: dict[str, dict[str, list[Run]]], sources: list[str], exact: bool = True) -> dict[str, Any]:
    """Per type: plain tok/s and tokens; per source: speedup (median of paired ratios), tok/s,
    acceptance, K, same tokens as plain. Per source over the types: mean and geometric mean."""
    out: dict[str, Any] = {"types": {}, "sources": {}}
    for t, by in runs.items():
        plain = by["plain"]
        if not plain:
            continue
        row: dict[str, Any] = {"plain_tok_s": med([x.tok_s for x in plain]),
                               "tokens": med([len(x.tokens) for x in plain])}
        for s in sources:
            pairs = [b.tok_s / a.tok_s for a, b in zip(plain, by[s], strict=False)]
            row[s] = {"speedup": med(pairs), "tok_s": med([x.tok_s for x in by[s]])} | spec_totals(by[s])
            if exact:
                row[s]["same"] = sum(a.tokens == b.tokens for a, b in zip(plain, by[s], strict=False))
                row[s]["runs"] = len(by[s])
        out["types"][t] = row
    for s in sources:
        ups = [row[s]["speedup"] for row in out["types"].values()]
        allruns = [x for by in runs.values() for x in by[s]]
        out["sources"][s] = {"mean_speedup": statistics.fmean(ups) if ups else float("nan"),
                             "geomean_speedup": statistics.geometric_mean(ups) if ups else float("nan"),
                             "min_speedup": min(ups, default=float("nan"))} | spec_totals(allruns)
        if exact:
            out["sources"][s]["same"] = sum(row[s]["same"] for row in out["types"].values())
            out["sources"][s]["runs"] = sum(row[s]["runs"] for row in out["types"].values())
    return out


# --- (2) the full stack against a naive pipeline -------------------------------------------------


def measure_stack(naive: Engine, full: Engine, prompts: dict[str, list[int]], n: int, streams: int, rounds: int,
                  stops: frozenset[int], label: str, deadline: float) -> dict[str, list[dict[str, Any]]]:
    """Per round: naive (1 stream, full logits), top1 (1 stream), groups (`streams` streams, no
    speculation), full (`streams` streams speculating); the prompt types rotate over rounds."""
    types = list(prompts)

    def batch(r: int) -> list[list[int]]:
        return [prompts[types[(streams * r + i) % len(types)]] for i in range(streams)]

    def one(name: str, r: int) -> dict[str, Any]:
        if name == "naive":
            runs = run_all(naive, [Request(batch(r)[0], SamplingConfig(max_tokens=n, want_logits=True), stops)])
        elif name == "top1":
            runs = run_all(naive, [Request(batch(r)[0], SamplingConfig(max_tokens=n), stops)])
        else:
            runs = run_all(full, [Request(p, SamplingConfig(max_tokens=n), stops, speculative=name == "full")
                                  for p in batch(r)])
        return {"tok_s": aggregate_tok_s(runs), "per_stream_tok_s": med([x.tok_s for x in runs]),
                "sum_tok_s": sum(x.tok_s for x in runs),
                "tokens": sum(len(x.tokens) for x in runs)} | (spec_totals(runs) if name == "full" else {})

    systems = ["naive", "top1", "groups", "full"]
    for name in systems:  # warm-up
        one(name, 0)
    got: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(rounds):
        if r and time.monotonic() > deadline:
            print(f"  {label}: time box, stopping after {r} rounds", file=sys.stderr)
            break
        for name in (systems if r % 2 == 0 else systems[::-1]):
            got[name].append(one(name, r))
        print(f"  {label} round {r + 1}/{rounds}: " + ", ".join(f"{s} {got[s][-1]['tok_s']:.1f}" for s in systems)
              + f" tok/s; full/naive {got['full'][-1]['tok_s'] / got['naive'][-1]['tok_s']:.2f}x",
              file=sys.stderr, flush=True)
    return got


def summarize_stack(got: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    naive = got["naive"]
    out: dict[str, Any] = {}
    for s, xs in got.items():
        out[s] = {"tok_s": med([x["tok_s"] for x in xs]),
                  "vs_naive": med([x["tok_s"] / a["tok_s"] for a, x in zip(naive, xs, strict=False)]),
                  "per_stream_tok_s": med([x["per_stream_tok_s"] for x in xs]),
                  "sum_tok_s": med([x["sum_tok_s"] for x in xs]),
                  "sum_vs_naive": med([x["sum_tok_s"] / a["tok_s"] for a, x in zip(naive, xs, strict=False)])}
    full = got["full"]
    drafted, accepted, steps = (sum(x["drafted"] for x in full), sum(x["accepted"] for x in full),
                                sum(x["steps"] for x in full))
    out["full"] |= {"acceptance": accepted / drafted if drafted else 0.0, "k_mean": drafted / steps if steps else 0.0}
    return out


# --- tables --------------------------------------------------------------------------------------


def show(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)] if rows else \
            [len(h) for h in headers]
        print(f"\n{title}")
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        return
    print(f"\n{title}")  # a plain line: a table's own title would wrap at the table's width
    table = Table()
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=max(120, 14 * len(headers) + 20), highlight=False).print(table)


def f(x: float, spec: str = ".2f") -> str:
    return "-" if x != x else format(x, spec)


def print_spec(place: str, s: dict[str, Any], sources: list[str], n: int, rounds: int) -> None:
    headers = ["type", "tokens", "plain tok/s"] + [f"{src}: x (acc, K)" for src in sources]
    rows = []
    for t, row in s["types"].items():
        rows.append([t, f(row["tokens"], ".0f"), f(row["plain_tok_s"], ".1f")] + [
            f"{f(row[src]['speedup'])} ({f(row[src]['acceptance'])}, {f(row[src]['k_mean'], '.1f')})"
            + ("" if row[src].get("same", row[src].get("runs")) == row[src].get("runs") else
               f" same {row[src]['same']}/{row[src]['runs']}") for src in sources])
    rows.append(["mean", "", ""] + [f"{f(s['sources'][src]['mean_speedup'])} ({f(s['sources'][src]['acceptance'])}, "
                                    f"{f(s['sources'][src]['k_mean'], '.1f')})" for src in sources])
    rows.append(["geomean", "", ""] + [f(s["sources"][src]["geomean_speedup"]) for src in sources])
    same = ", ".join(f"{src} {s['sources'][src].get('same', '-')}/{s['sources'][src].get('runs', '-')}"
                     for src in sources)
    show(f"{place}: speedup over plain decoding (acceptance, K = drafts per verify step); up to {n} tokens, "
         f"{rounds} rounds; runs with the same tokens as plain: {same}", headers, rows)


# --- driver ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 types, 0 ms only, 16 tokens, 1 round")
    p.add_argument("--parts", default="spec,stack,sampled", help="spec, stack, sampled")
    p.add_argument("--types", default=",".join(PROMPTS))
    p.add_argument("--sources", default="ngram,int8,int4,layers:24")
    p.add_argument("--delays", default="0,20,50,100", help="ms per hop through the relay (workers)")
    p.add_argument("--no-inproc", action="store_true", help="(1): skip the in-process placement")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--far-tokens", type=int, default=48, help="tokens per request at delays >= --far-from")
    p.add_argument("--far-from", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--far-rounds", type=int, default=2)
    p.add_argument("--k", default="auto", help="drafts per verify step: auto or a number")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--ignore-stops", action="store_true")
    p.add_argument("--streams", type=int, default=4, help="(2): streams of the full stack")
    p.add_argument("--groups", type=int, default=None, help="(2): decode groups (default: the serve default, one "
                   "per stage with workers)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="(2): relay bandwidth cap per direction")
    p.add_argument("--stack-source", default="", help="(2): draft source of the full stack (default: best in (1))")
    p.add_argument("--stack-rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.7, help="(3)")
    p.add_argument("--sampled-rounds", type=int, default=1, help="(3)")
    p.add_argument("--sampled-k", default="4", help="(3): drafts per verify step, a number or auto (in process a "
                   "draft model costs about what the target does, so auto K offers almost none)")
    p.add_argument("--max-minutes", type=float, default=75.0, help="skip remaining rounds and placements after this")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardline-bench")
    args = p.parse_args()
    todo = set(args.parts.split(","))
    types = args.types.split(",")
    sources = [s for s in args.sources.split(",") if s]
    delays = [float(d) for d in args.delays.split(",") if d]
    n, far_n, rounds, far_rounds = args.tokens, args.far_tokens, args.rounds, args.far_rounds
    stack_rounds, sampled_rounds = args.stack_rounds, args.sampled_rounds
    if args.quick:
        types = [t for t in ("chat", "translation") if t in types] or types[:2]
        delays, n, far_n, rounds, far_rounds, stack_rounds, sampled_rounds = [0.0], 16, 16, 1, 1, 1, 1
    if unknown := [t for t in types if t not in PROMPTS]:
        p.error(f"unknown types {unknown}: {', '.join(PROMPTS)}")
    if n < 3 or far_n < 3:
        p.error("--tokens and --far-tokens must be at least 3")
    k = None if args.k == "auto" else int(args.k)
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    load = os.getloadavg()[0]
    watch = LoadWatch()
    git = git_state()
    f2, f3 = shard_folder(args.work, 2, balance=True), shard_folder(args.work, 3)
    drafts = {s: draft_path(s, args.work) for s in sources}
    if args.stack_source and args.stack_source not in drafts:
        drafts[args.stack_source] = draft_path(args.stack_source, args.work)
    tok = ChatTokenizer(f2)
    prompts = {t: tok.encode_chat([{"role": "user", "content": PROMPTS[t]}]) for t in types}
    stops = frozenset() if args.ignore_stops else frozenset(tok.stop_ids)

    def spec_cfg(source: str, fixed: int | None | str = "") -> SpeculationConfig:
        return SpeculationConfig(draft=drafts[source], k=k if fixed == "" else fixed, k_max=args.k_max)

    def tokens_at(delay: float | None) -> tuple[int, int]:
        return (far_n, far_rounds) if delay is not None and delay >= args.far_from else (n, rounds)

    spec_results: dict[str, dict[str, Any]] = {}  # placement -> summary
    spec_tokens: dict[str, int] = {}
    stack_results: dict[str, dict[str, Any]] = {}
    sampled: dict[str, Any] | None = None
    skipped: list[str] = []
    systems = ["plain", *sources]

    # (1) in process
    if "spec" in todo and not args.no_inproc:
        with engines() as eng:
            eng.open("plain", f2, None, SpeculationConfig())
            for s in sources:
                eng.open(s, f2, None, spec_cfg(s))
            runs = measure_spec(eng, systems, prompts, n, rounds, stops, "in process", deadline)
        spec_results["inproc"], spec_tokens["inproc"] = summarize_spec(runs, sources), n

    # (1) and (2) on 2 workers, through relays
    stack_source = args.stack_source
    if ("spec" in todo or "stack" in todo) and delays:
        worker_procs: list[Proc] = []
        try:
            for stage in ("1", "2"):
                worker_procs.append(Proc(["worker", "--shards", str(f3), "--stage", stage, "--listen", "127.0.0.1:0",
                                          "--insecure"],
                                         "listening on "))
            addrs = [w.line.split()[-1] for w in worker_procs]
            if "spec" in todo:
                for d in delays:
                    if time.monotonic() > deadline:
                        skipped.append(f"spec workers {d:g} ms")
                        continue
                    m, rr = tokens_at(d)
                    with relays(addrs, d, None) as via, engines() as eng:
                        eng.open("plain", f3, via, SpeculationConfig())
                        for s in sources:
                            eng.open(s, f3, via, spec_cfg(s))
                        runs = measure_spec(eng, systems, prompts, m, rr, stops, f"workers {d:g} ms", deadline)
                    spec_results[f"workers-{d:g}ms"], spec_tokens[f"workers-{d:g}ms"] = summarize_spec(runs, sources), m
            if "stack" in todo:
                if not stack_source:
                    measured = [v for k_, v in spec_results.items() if k_.startswith("workers-")] or \
                        list(spec_results.values())
                    stack_source = max(sources, key=lambda s: measured[-1]["sources"][s]["mean_speedup"]) \
                        if measured and sources else "ngram"
                    drafts.setdefault(stack_source, draft_path(stack_source, args.work))
                for d in delays:
                    if time.monotonic() > deadline:
                        skipped.append(f"stack {d:g} ms")
                        continue
                    m, _ = tokens_at(d)
                    with relays(addrs, d, args.rate_mbit) as via, engines() as eng:
                        naive = eng.open("naive", f3, via, SpeculationConfig(), args.groups)
                        full = eng.open("full", f3, via, spec_cfg(stack_source), args.groups)
                        got = measure_stack(naive, full, prompts, m, args.streams, stack_rounds, stops,
                                            f"stack {d:g} ms", deadline)
                    stack_results[f"{d:g}ms"] = summarize_stack(got) | {"tokens": m}
        finally:
            for w in worker_procs:
                w.stop()

    # (3) sampled drafts, in process
    model_sources = [s for s in sources if s != "ngram"]
    if "sampled" in todo and model_sources:
        if time.monotonic() > deadline:
            skipped.append("sampled")
        else:
            with engines() as eng:
                eng.open("plain", f2, None, SpeculationConfig())
                for s in model_sources:
                    eng.open(s, f2, None, spec_cfg(s, None if args.sampled_k == "auto" else int(args.sampled_k)))
                runs = measure_spec(eng, ["plain", *model_sources], prompts, n, sampled_rounds, stops,
                                    f"sampled T={args.temperature:g}", deadline, {"temperature": args.temperature})
            sampled = summarize_spec(runs, model_sources, exact=False)
            for s in model_sources:
                x = sampled["sources"][s]
                x["q_support_bytes_per_step"] = x["k_mean"] * Q_SUPPORT_BYTES  # mean over every verify step
                # per step that drafts, as the step builds it: (its drafts + 1) entries of Q_ENTRY_BYTES
                x["drafted_entry_bytes_per_drafting_step_at_k"] = {k_: (k_ + 1) * Q_ENTRY_BYTES for k_ in (1, 4, 8)}

    # --- report ------------------------------------------------------------------------------------
    minutes = (time.monotonic() - started) / 60
    during = watch.stop()
    print(f"\ncommit {git['commit']}{' (src/ had uncommitted changes)' if git['src_dirty'] else ''}; load during the "
          f"run: median {during['load_median']}, max {during['load_max']}, a pytest running in "
          f"{during['pytest_share']:.0%} of {during['samples']} samples")
    print(f"default model (SmolLM2-135M, gguf weights, exact precision), greedy, stop tokens "
          f"{'ignored' if args.ignore_stops else 'honoured'}, K {args.k} (max {args.k_max}); load average "
          f"{load:.1f} at start; {minutes:.1f} min")
    for place, s in spec_results.items():
        print_spec(place, s, sources, spec_tokens[place], tokens_at(None if place == "inproc" else
                                                                      float(place[8:-2]))[1])
    if spec_results:
        headers = ["placement"] + [f"{src}: mean x" for src in sources] + ["best"]
        rows = []
        for place, s in spec_results.items():
            best = max(sources, key=lambda src: s["sources"][src]["mean_speedup"])
            rows.append([place] + [f(s["sources"][src]["mean_speedup"]) for src in sources] + [best])
        show("mean speedup over the prompt types", headers, rows)
    if stack_results:
        headers = ["delay/hop", "tokens", "naive tok/s", "top-1 1 stream", "groups no spec", "full stack",
                   "full / naive", "groups / naive", "top-1 / naive", "full acc", "full K", "full sum / naive"]
        rows = [[d, str(x["tokens"]), f(x["naive"]["tok_s"], ".1f"), f(x["top1"]["tok_s"], ".1f"),
                 f(x["groups"]["tok_s"], ".1f"), f(x["full"]["tok_s"], ".1f"), f(x["full"]["vs_naive"]),
                 f(x["groups"]["vs_naive"]), f(x["top1"]["vs_naive"]), f(x["full"]["acceptance"]),
                 f(x["full"]["k_mean"], ".1f"), f(x["full"]["sum_vs_naive"])] for d, x in stack_results.items()]
        groups = args.groups if args.groups is not None else "default"
        show(f"full stack ({args.streams} streams, decode groups {groups}"
             f", speculation {stack_source}, top-1) vs naive (1 stream, no speculation, full logits), 2 workers, "
             f"relay capped at {args.rate_mbit:g} Mbit/s; aggregate tok/s (the burst's tokens over its first "
             "to last token: the slowest stream sets it); sum = each stream's own tok/s added; ratios: medians "
             "of per-round ratios",
             headers, rows)
    if sampled is not None:
        headers = ["source", "mean x", "acceptance", "K", "q support B/step"]
        rows = [[s, f(x["mean_speedup"]), f(x["acceptance"]), f(x["k_mean"], ".1f"),
                 f(x["q_support_bytes_per_step"], ".0f")] for s, x in sampled["sources"].items()]
        show(f"sampled drafts (T={args.temperature:g}), in process, K {args.sampled_k}, up to {n} tokens; per row, "
             f"a verify step offering K drafts carries K x {Q_SUPPORT_BYTES} B of q's support (SUPPORT {SUPPORT} x "
             f"(i64 id + f32 probability)); as the step builds it, (K + 1) x {Q_ENTRY_BYTES} B (+ the draft "
             f"token, and a padded entry at the last position): "
             f"{', '.join(f'K={k_}: {(k_ + 1) * Q_ENTRY_BYTES} B' for k_ in (1, 4, 8))}"
             "; 'q support B/step' is the mean over every verify step (K from the table)", headers, rows)
    if skipped:
        print(f"time box: skipped {', '.join(skipped)}")

    # --- figures -----------------------------------------------------------------------------------
    figures: dict[str, Any] = {}
    for place, s in spec_results.items():
        best = max(sources, key=lambda src: s["sources"][src]["mean_speedup"])
        figures[f"ratio_best_mean_speedup_{place}"] = round(s["sources"][best]["mean_speedup"], 3)
        figures[f"best_source_{place}"] = best
    for at, x in stack_results.items():
        figures[f"ratio_full_stack_vs_naive_{at}"] = round(x["full"]["vs_naive"], 3)
    targets: dict[str, Any] = {}
    for place in ("inproc", "workers-0ms"):
        if place in spec_results:
            targets[f"mean_speedup_ge_1.5_{place}"] = figures[f"ratio_best_mean_speedup_{place}"] >= 1.5
    far = [p_ for p_ in spec_results if p_.startswith("workers-") and float(p_[8:-2]) >= 20]
    if far:
        targets["mean_speedup_ge_3_at_20ms_and_beyond"] = all(figures[f"ratio_best_mean_speedup_{p_}"] >= 3
                                                              for p_ in far)
    if "100ms" in stack_results:
        targets["full_stack_ge_8x_naive_at_100ms"] = stack_results["100ms"]["full"]["vs_naive"] >= 8
    figures["targets_met"] = targets
    figures |= {"tokens": n, "far_tokens": far_n, "far_from_ms": args.far_from, "rounds": rounds,
                "far_rounds": far_rounds, "stops_honoured": not args.ignore_stops, "k": args.k, "k_max": args.k_max,
                "stack_source": stack_source, "streams": args.streams, "rate_mbit": args.rate_mbit,
                "load_avg_1m_at_start": round(load, 2), "load_during": during, "minutes": round(minutes, 1),
                "skipped": skipped} | git

    def rounded(x: Any) -> Any:
        if isinstance(x, float):
            return round(x, 3)
        if isinstance(x, dict):
            return {k_: rounded(v) for k_, v in x.items()}
        return x

    figures["spec"] = rounded(spec_results)
    figures["stack"] = rounded(stack_results)
    if sampled is not None:
        figures["sampled"] = rounded(sampled) | {"temperature": args.temperature, "k": args.sampled_k}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
