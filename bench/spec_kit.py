"""What bench/speculative.py is built from (its full-stack and sampled-draft siblings,
spec_stack.py and spec_sampled.py, were retired in issue 41): the prompt types, named engines
built by server's composition root, one request's run and its speculation totals, the per-type
measurement, tables and figures. bench/ is on sys.path when a script runs, so `from spec_kit import ...`."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit import open_serving, shard_folder

from shardline.config import RunConfig, SamplingConfig, ServeConfig, SpeculationConfig
from shardline.model.manifest import EXPORT_TAG
from shardline.model.tokenizer import ChatTokenizer
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
    "edit": "Rewrite this function so it skips None values and returns 0.0 for an empty list. Answer with the "
            "whole function only.\n\n```python\ndef average(values):\n    \"\"\"The mean of a list of numbers.\"\"\"\n"
            "    total = 0\n    count = 0\n    for value in values:\n        total = total + value\n"
            "        count = count + 1\n    return total / count\n```",
    "rewrite": "Summarize the following text in three sentences:\n\nThe city council met on Tuesday to discuss the "
               "new public library. The library will be built near the central park and will include a children's "
               "reading room, a computer lab and a cafe. Construction will start in the spring and is expected to "
               "take two years. The council said the project will cost twelve million dollars, paid for by a state "
               "grant and local taxes. Some residents worried about traffic near the park, and the council promised "
               "a study of parking and bus routes before construction begins.",
}
REQUEST_TIMEOUT_S = 600.0


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


def provenance(s: Setup, watch: LoadWatch, git: dict[str, Any]) -> dict[str, Any]:
    """Print what the run measured and under what load (the commit, the load during and at its
    start, a pytest seen meanwhile, its minutes); the same as figures for the JSON line."""
    minutes = (time.monotonic() - s.started) / 60
    during = watch.stop()
    print(f"\ncommit {git['commit']}{' (src/ had uncommitted changes)' if git['src_dirty'] else ''}; load during the "
          f"run: median {during['load_median']}, max {during['load_max']}, a pytest running in "
          f"{during['pytest_share']:.0%} of {during['samples']} samples; load average {s.load:.1f} at start; "
          f"{minutes:.1f} min")
    return {"load_avg_1m_at_start": round(s.load, 2), "load_during": during, "minutes": round(minutes, 1)} | git


def git_state() -> dict[str, Any]:
    """The commit measured, and whether src/ had uncommitted changes (another engineer's work)."""
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "src_dirty": bool(git("status", "--short", "src"))}


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
    from shardline.model.catalog import CATALOG

    if source in CATALOG:  # a real model file of `shardline pull`, its own weights, one stage
        from shardline.export.pull import pull
        from shardline.model.catalog import named

        return str(shard_folder(work, 1, model=pull(named(source))))
    if not (Path(source) / "manifest.json").is_file():
        raise SystemExit(f"unknown draft source {source!r} (ngram, int8, int4, layers:L, a name of "
                         "`shardline pull` or an export folder)")
    return source


class Engines:
    """Named engines over one placement (every stage here, or the given workers); all stopped on
    close, each guarded."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}

    def open(self, name: str, folder: Path, workers: list[str] | None, spec: SpeculationConfig,
             groups: int | None = None) -> Engine:
        engine, _ = open_serving(folder, RunConfig(), ServeConfig(decode_groups=groups), workers, activations="f16",
                                 spec=spec)
        assert isinstance(engine, Engine)
        self.engines[name] = engine
        return engine

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    def close(self) -> None:
        for name, engine in self.engines.items():
            try:
                engine.shutdown()
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


def spec_totals(runs: list[Run]) -> dict[str, Any]:
    """Acceptance (overall and by draft position), mean K and tokens per verify step over every
    speculating run given."""
    stats = [r.spec for r in runs if r.spec is not None]
    drafted, accepted, steps = (sum(s.drafted for s in stats), sum(s.accepted for s in stats),
                                sum(s.steps for s in stats))
    total = sum(stats, SpecStats(0, 0, 0, 0))
    return {"acceptance": accepted / drafted if drafted else 0.0, "k_mean": drafted / steps if steps else 0.0,
            "tokens_per_step": sum(len(r.tokens) - 1 for r in runs) / steps if steps else 0.0,
            "acceptance_at": [round(a, 3) for a in total.acceptance_at()],
            "drafted": drafted, "accepted": accepted, "steps": steps}


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


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
    for src in sources:
        x = s["sources"][src]
        print(f"  {src}: acceptance by draft position {x['acceptance_at']}, {f(x['tokens_per_step'])} tokens per "
              "verify step")


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


@dataclass
class Setup:
    """What every speculation benchmark starts from: the parsed flags, the exports, the prompts
    (chat-templated), the stop tokens and the draft sources resolved to folders."""

    args: argparse.Namespace
    f2: Path  # the default 2-stage balanced export (in process)
    f3: Path  # a 3-stage export (stage 0 here, stages 1 and 2 on workers)
    prompts: dict[str, list[int]]
    stops: frozenset[int]
    drafts: dict[str, str]
    load: float = field(default_factory=lambda: os.getloadavg()[0])
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.started + self.args.max_minutes * 60

    def spec_cfg(self, source: str, k: int | None) -> SpeculationConfig:
        if source not in self.drafts:
            self.drafts[source] = draft_path(source, self.args.work)
        return SpeculationConfig(draft=self.drafts[source], k=k, k_max=self.args.k_max)


def common_flags(p: argparse.ArgumentParser, sources: str) -> None:
    p.add_argument("--model", help="the target: a name of `shardline pull` or a GGUF file (default: the embedded "
                                   "model)")
    p.add_argument("--types", default=",".join(PROMPTS))
    p.add_argument("--sources", default=sources)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--ignore-stops", action="store_true")
    p.add_argument("--max-minutes", type=float, default=75.0, help="skip remaining rounds and placements after this")
    p.add_argument("--work", type=Path, default=Path(__import__("tempfile").gettempdir()) / "shardline-bench")


def setup(p: argparse.ArgumentParser, args: argparse.Namespace, quick_types: bool) -> Setup:
    types = args.types.split(",")
    if quick_types:
        types = [t for t in ("chat", "translation") if t in types] or types[:2]
    if unknown := [t for t in types if t not in PROMPTS]:
        p.error(f"unknown types {unknown}: {', '.join(PROMPTS)}")
    from shardline.export.pull import resolve_model

    model = resolve_model(Path(args.model)) if args.model else None
    f2, f3 = shard_folder(args.work, 2, balance=True, model=model), shard_folder(args.work, 3, model=model)
    tok = ChatTokenizer(f2)
    prompts = {t: tok.encode_chat([{"role": "user", "content": PROMPTS[t]}]) for t in types}
    stops = frozenset() if args.ignore_stops else frozenset(tok.stop_ids)
    drafts = {s: draft_path(s, args.work) for s in args.sources.split(",") if s}
    return Setup(args, f2, f3, prompts, stops, drafts)
