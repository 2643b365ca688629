"""No stutter (issue 23): what long prompts arriving do to streams that are decoding.

Four chat streams decode steadily (the default model, its default 2-stage export, exact
precision, stop tokens ignored); then prompts of 1k, 3k and 8k tokens arrive one at a time
(each after the one before has its first token), then the three in a burst. For each case, over
its window (the first prompt's submission to the last one's first token):

- the running streams' gaps between tokens that overlap the window: p50, p99, max, against the
  steady median (measured over `--steady` seconds before the first case);
- their tokens/s in the window against their steady tokens/s;
- each long prompt's time to first token against its TTFT on the same server when idle.

Systems, each built by the composition root (server.py) as `shardline serve` builds it:
- old: fixed 128-token chunks beside every decode step (`pacing=None`, the policy before issue 23);
- new: chunks sized to the time budget, prefill's share of the time (serving/pacing.py, defaults);
- disagg: 1 prefill + 1 decode instance (TetriInfer): the running streams decode on the decode
  instance while the prompts prefill on the other;
- paged: the default model's paged export (issue 41: every stream's decode token and the prompt's
  chunk fused in one call of each stage, sized by the same pacing); over workers, one fused step
  in flight per stage.
Placements: in this process, and with 2 workers (`shardline worker` on loopback, stage 1 each
instance's; stage 0 here). Targets (coupled, new, defaults): the longest gap <= 4x the steady
median, >= 50% of the steady rate in the window, TTFT <= 2x idle.

    python bench/interference.py --quick      # in process, old and new, prompts of 300 and 600 (CI)
    python bench/interference.py              # everything (~15 min)
    python bench/interference.py --prefix     # each long prompt hits its own kept prefix while streams decode

The last line on stdout is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from kit import TEXT, Proc  # bench/ is on sys.path when this script runs
from trackers import Tracker, wait_for

from shardline.config import PacingConfig, RunConfig, SamplingConfig, ServeConfig
from shardline.export.defaults import default_shards
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_disaggregated, open_engine
from shardline.serving.engine import Request, Serving

CHATS = ["Write a long story about a lighthouse keeper who finds a message in a bottle.",
         "Explain in detail how a bicycle stays upright.", "Describe every planet of the solar system.",
         "Write a long letter to a friend about a trip to the mountains."]
SYSTEMS = ("old", "new", "disagg", "paged")


@dataclass
class Case:
    name: str
    lengths: list[int]
    start: float = 0.0
    end: float = 0.0
    ttft: list[float] = field(default_factory=list)


def first_tokens(serving: Serving, prompts: list[list[int]]) -> list[float]:
    """Submit `prompts` at once; each one's time to first token (one token each)."""
    trackers = [Tracker() for _ in prompts]
    start = time.perf_counter()
    for p, t in zip(prompts, trackers, strict=True):
        serving.submit(Request(p, SamplingConfig(max_tokens=1), frozenset()), t)
    for t in trackers:
        if not t.done.wait(900) or not t.times:
            raise RuntimeError(f"a long prompt did not finish: {t.error}")
    return [t.times[0] - start for t in trackers]


def scenario(serving: Serving, chats: list[list[int]], longs: dict[int, list[int]], steady_s: float,
             burst: bool) -> dict[str, Any]:
    """Each long prompt's idle TTFT; then per case, with four fresh streams decoding (so that no
    case inherits another's long contexts): their steady pace, then the case's prompts."""
    idle = {n: first_tokens(serving, [p])[0] for n, p in longs.items()}
    cases = [Case(f"{n // 1000}k" if n >= 1000 else str(n), [n]) for n in longs]
    if burst:
        cases.append(Case("burst of 3", list(longs)))
    out: dict[str, Any] = {"cases": {}, "idle_ttft_s": {str(n): t for n, t in idle.items()}}
    for case in cases:
        runners = [Tracker() for _ in chats]
        room = 8000 - max(len(c) for c in chats)
        tickets = [serving.submit(Request(c, SamplingConfig(max_tokens=room), frozenset()), t)
                   for c, t in zip(chats, runners, strict=True)]
        try:
            wait_for(lambda rs=runners: all(len(t.times) >= 8 for t in rs), 120, "the running streams did not start")
            steady = (time.perf_counter(), 0.0)
            time.sleep(steady_s)
            steady = (steady[0], time.perf_counter())
            case.start = time.perf_counter()
            case.ttft = first_tokens(serving, [longs[n] for n in case.lengths])
            case.end = time.perf_counter()
            if errors := [t.error for t in runners if t.error]:
                raise RuntimeError("a running stream failed: " + "; ".join(errors))
        finally:
            for ticket in tickets:
                serving.cancel(ticket)
            for t in runners:
                t.done.wait(60)
        out["cases"][case.name] = measure(runners, steady, case, idle)
    return out


def gaps_in(runners: list[Tracker], lo: float, hi: float, overlapping: bool) -> list[float]:
    out = []
    for t in runners:
        for a, b in zip(t.times, t.times[1:], strict=False):
            if (b > lo and a < hi) if overlapping else (lo <= a and b <= hi):
                out.append(b - a)
    return out


def tokens_in(runners: list[Tracker], lo: float, hi: float) -> int:
    return sum(sum(lo < x <= hi for x in t.times) for t in runners)


def measure(runners: list[Tracker], steady: tuple[float, float], c: Case, idle: dict[int, float]) -> dict[str, Any]:
    """The case's window ends at the last first token, or earlier where a running stream used up
    its context (8000 tokens) first: the streams' figures are read while all four ran."""
    steady_median = statistics.median(gaps_in(runners, *steady, overlapping=False))
    steady_rate = tokens_in(runners, *steady) / (steady[1] - steady[0])
    end = min([c.end] + [t.times[-1] for t in runners if t.finish.startswith("length")])
    gaps = gaps_in(runners, c.start, end, overlapping=True)
    return {
        "window_s": c.end - c.start, "streams_window_s": end - c.start,
        "steady_gap_median_ms": 1e3 * steady_median, "steady_tok_s": steady_rate,
        "gap_p50_ms": 1e3 * float(np.percentile(gaps, 50)), "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
        "gap_max_ms": 1e3 * max(gaps), "max_gap_over_steady": max(gaps) / steady_median,
        "rate_over_steady": tokens_in(runners, c.start, end) / (end - c.start) / steady_rate,
        "ttft_s": max(c.ttft), "ttft_over_idle": max(t / idle[n] for t, n in zip(c.ttft, c.lengths, strict=True)),
    }


@contextmanager
def system(name: str, folder: Path, placement: str, pacing: PacingConfig, prefix: bool = False) -> Iterator[Serving]:
    """A server's engine (or front) for `name`, its stages in this process or on workers. Prefix
    reuse off unless `prefix`: each case's long prompt is the idle run's, which a kept prefix
    answers (with `prefix`, that hit is what is measured: issue 41's stall on a kept prefix)."""
    base = ServeConfig(max_streams=8, pacing=None if name == "old" else pacing,
                       prefix_cache_mb=None if prefix else 0)
    instances = 2 if name == "disagg" else 1
    folder = default_shards(False, paged=True) if name == "paged" else folder
    workers = [Proc(["worker", "--shards", str(folder), "--stage", "1", "--listen", "127.0.0.1:0", "--insecure"],
                    "listening on ") for _ in range(instances if placement == "workers" else 0)]
    addrs = [w.addr for w in workers] or None
    serving: Serving
    try:
        if name == "paged":
            serving, _ = open_engine(folder, RunConfig(), base, addrs)
        elif name == "disagg":
            cfg = replace(base, disaggregate=(1, 1), length_predictor="max-tokens")
            serving, _ = open_disaggregated(folder, RunConfig(), cfg, addrs)
        else:
            serving, _ = open_engine(folder, RunConfig(), base, addrs)
        try:
            yield serving
        finally:
            serving.shutdown()
    finally:
        for w in workers:
            w.stop()


def api_path(folder: Path, chars: int, steady_s: float) -> dict[str, float]:
    """`shardline serve` with 3 streamed chat answers (the official `openai` client, one thread
    each); then a chat message of `chars` characters arrives (templated and tokenized off the
    event loop; past the context, so it ends in a 400 after that work). The streams' gaps at
    the client while it is handled, against their steady median."""
    import openai

    server = Proc(["serve", "--shards", str(folder), "--port", "0", "--model-id", "m", "--max-streams", "8"],
                  "serving ", stream="stderr")
    base = server.url
    times: list[list[float]] = [[] for _ in range(3)]
    stop = threading.Event()

    def stream(i: int) -> None:
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        for _ in client.chat.completions.create(model="m", stream=True, max_tokens=4000, temperature=0,
                                                messages=[{"role": "user", "content": CHATS[i]}]):
            times[i].append(time.perf_counter())
            if stop.is_set():
                break

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: all(len(x) >= 8 for x in times), 120, "the streams did not start")
        lo = time.perf_counter()
        time.sleep(steady_s)
        hi = time.perf_counter()
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        word = "lorem ipsum dolor sit amet "
        text = (word * (chars // len(word) + 1))[:chars]
        start = time.perf_counter()
        try:
            client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": text}])
            status = 200
        except openai.BadRequestError:
            status = 400
        end = time.perf_counter()
        time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        server.stop()
    trackers = [Tracker() for _ in times]
    for t, x in zip(trackers, times, strict=True):
        t.times = x
    steady = statistics.median(gaps_in(trackers, lo, hi, overlapping=False))
    during = gaps_in(trackers, start, end, overlapping=True)
    return {"chars": chars, "status": status, "handled_s": end - start, "steady_gap_ms": 1e3 * steady,
            "max_gap_ms": 1e3 * max(during, default=0.0), "max_gap_over_steady": max(during, default=0.0) / steady}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--placements", default="process,workers")
    p.add_argument("--lengths", default="1000,3000,8000")
    p.add_argument("--steady", type=float, default=3.0, help="seconds of steady decoding measured first")
    p.add_argument("--budget", type=float, default=PacingConfig.budget, help="the new policy's --prefill-budget")
    p.add_argument("--share", type=float, default=PacingConfig.share, help="the new policy's --prefill-share")
    p.add_argument("--quick", action="store_true", help="in process, old and new, 300 and 600 tokens, no burst")
    p.add_argument("--prefix", action="store_true",
                   help="prefix reuse on: each long prompt hits the kept prefix of its idle run (beside decoding)")
    args = p.parse_args()
    if args.quick:
        args.systems, args.placements, args.lengths, args.steady = "old,new", "process", "300,600", 1.0
    folder = default_shards(progress=False, paged=False)
    tok = ChatTokenizer(folder)
    chats = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    text = tok.encode(TEXT)
    longs = {n: [100 + n % 7] + (text * (n // len(text) + 1))[: n - 1] for n in map(int, args.lengths.split(","))}
    results: dict[str, dict[str, Any]] = {}
    for placement in args.placements.split(","):
        for name in args.systems.split(","):
            with system(name, folder, placement, PacingConfig(args.budget, args.share), args.prefix) as serving:
                first_tokens(serving, [chats[0]])  # warm-up
                results[f"{name} {placement}"] = scenario(serving, chats, longs, args.steady, not args.quick)
            print(f"{name} {placement} done", file=sys.stderr, flush=True)
    api = None if args.quick or args.prefix else api_path(folder, 100_000, args.steady)
    report(results, api)
    return 0


def report(results: dict[str, dict[str, Any]], api: dict[str, float] | None) -> None:
    print(f"{'system':<18}{'case':<12}{'steady ms':>9}{'gap p50 ms':>11}{'p99':>8}{'max':>8}{'max/steady':>11}"
          f"{'rate/steady':>12}{'TTFT s':>8}{'TTFT/idle':>10}")
    figures: dict[str, Any] = {}
    for sysname, r in results.items():
        print(sysname)
        for case, c in r["cases"].items():
            print(f"{'':<18}{case:<12}{c['steady_gap_median_ms']:>9.1f}{c['gap_p50_ms']:>11.1f}{c['gap_p99_ms']:>8.0f}{c['gap_max_ms']:>8.0f}"
                  f"{c['max_gap_over_steady']:>11.1f}{c['rate_over_steady']:>12.2f}{c['ttft_s']:>8.2f}"
                  f"{c['ttft_over_idle']:>10.2f}")
            key = f"{sysname.replace(' ', '_')}_{case.replace(' ', '_')}"
            figures[f"{key}_max_gap_over_steady"] = round(c["max_gap_over_steady"], 2)
            figures[f"{key}_rate_over_steady"] = round(c["rate_over_steady"], 3)
            figures[f"{key}_ttft_over_idle"] = round(c["ttft_over_idle"], 3)
    if api is not None:
        print(f"API path: a {api['chars']:,}-character message (answered {api['status']} in "
              f"{api['handled_s']:.2f} s) while 3 answers stream: their longest gap {api['max_gap_ms']:.0f} ms, "
              f"{api['max_gap_over_steady']:.1f}x their steady median ({api['steady_gap_ms']:.1f} ms)")
        figures["api_100k_chars_max_gap_over_steady"] = round(api["max_gap_over_steady"], 2)
    print(json.dumps(figures | {"results": results, "api": api}))


if __name__ == "__main__":
    sys.exit(main())
