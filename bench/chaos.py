"""No request lost when workers die or hang (issue 11, item 3): streamed requests through a 3-stage
pipeline (stage 0 in this process, stages 1 and 2 on `shardline worker` processes on 127.0.0.1)
while workers are killed (SIGKILL, then restarted on the same port) and hung (SIGSTOP, then
SIGCONT after a moment) at random at a set rate (seeded).

The same requests (prompt and length drawn from a seed, greedy, `--concurrency` at a time, closed
loop) run twice side by side: without faults, then with them. Reported: requests lost (ended
with an error or never; target 0), requests whose greedy answer differs from the run without
faults (target 0), e2e and TTFT p50/p99 in both runs, and per fault the time from the kill (or
the SIGSTOP) to the first token after it (of a stream replayed since, for kills; after the
SIGCONT, for hangs). Then a bounded soak at steady load with hangs (kills would reset the workers'
memory) samples the RSS of every process (start, half way, end, and the slope over the second
half), and this process's threads: target flat.

    python bench/chaos.py --quick
    python bench/chaos.py

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from kit import Proc, open_serving, shard_folder, wait_quiet  # bench/ is on sys.path when this script runs

from shardline.config import RecoveryConfig, SamplingConfig, ServeConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.serving.engine import Engine, Event, Request, Ticket

TEXTS = [
    "Rewrite this more formally: the meeting got moved to friday because the boss was sick, so bring the reports.",
    "Write a Python function that parses a CSV line into a list of fields, handling quoted commas.",
    "List ten countries in Europe with their capitals, one per line.",
    "Explain in a short paragraph how a refrigerator keeps food cold.",
    "Summarize: The committee met on Tuesday and agreed to extend the library's opening hours on weekends.",
    "Translate into French: I would like a table for two by the window, please.",
    "Write a short poem about the sea at night.",
    "What is 17 times 23? Explain the steps.",
]


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


class Worker:
    """`shardline worker` for one stage on a fixed port: killed and restarted, stopped and continued."""

    def __init__(self, folder: Path, stage: int) -> None:
        self.folder, self.stage = folder, stage
        self.proc = self._start(0)
        self.addr = self.proc.addr
        self.port = int(self.addr.rpartition(":")[2])

    def _start(self, port: int) -> Proc:
        return Proc(["worker", "--shards", str(self.folder), "--stage", str(self.stage), "--listen",
                     f"127.0.0.1:{port}", "--insecure"], "listening on")

    def kill_and_restart(self) -> float:
        """SIGKILL now (the time returned), then start again on the same port (ready on return)."""
        at = time.perf_counter()
        self.proc.stop()  # SIGKILL, reaped
        self.proc = self._start(self.port)
        return at

    def hang(self, seconds: float) -> tuple[float, float]:
        """SIGSTOP for `seconds`, then SIGCONT: (stopped at, continued at)."""
        os.kill(self.proc.proc.pid, signal.SIGSTOP)
        at = time.perf_counter()
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.proc.proc.pid, signal.SIGCONT)
        return at, time.perf_counter()

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.proc.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGCONT)  # never leave one stopped
        self.proc.stop()


@dataclass
class Fault:
    kind: str  # "kill" | "hang"
    stage: int
    at: float  # SIGKILL or SIGSTOP
    back: float  # restarted (ready) or continued


class Faults:
    """A thread injecting faults one at a time: after a gap drawn from an exponential of mean
    `every_s`, a kill or a hang of a worker drawn at random (seeded)."""

    def __init__(self, workers: list[Worker], every_s: float, hang_s: tuple[float, float], seed: int,
                 kinds: tuple[str, ...] = ("kill", "hang")) -> None:
        self.workers, self.every_s, self.hang_s, self.kinds = workers, every_s, hang_s, kinds
        self.rng = random.Random(seed)
        self.done: list[Fault] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="faults")

    def __enter__(self) -> Faults:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.expovariate(1 / self.every_s)):
            w = self.rng.choice(self.workers)
            if self.rng.choice(self.kinds) == "kill":
                at = w.kill_and_restart()
                self.done.append(Fault("kill", w.stage, at, time.perf_counter()))
            else:
                at, back = w.hang(self.rng.uniform(*self.hang_s))
                self.done.append(Fault("hang", w.stage, at, back))


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # each token's arrival
    replays_at: list[int] = field(default_factory=list)  # the stream's replays when each token arrived
    submitted: float = 0.0
    final: Event | None = None
    ended: float = 0.0
    ticket: Ticket | None = None  # until it ends (a finished request's stream is not kept)


def run_requests(engine: Engine, prompts: list[list[int]], lengths: list[int], concurrency: int,
                 timeout_s: float, submit_s: float | None = None) -> list[Outcome]:
    """Request i (prompt i mod len, lengths[i] tokens, greedy, stop tokens ignored), `concurrency`
    at a time (the next starts when one ends), bounded by `timeout_s` in all; with `submit_s`,
    none starts after that many seconds. The requests started, in order."""
    results: list[Outcome] = []
    slots = threading.Semaphore(concurrency)

    def on(r: Outcome) -> Callable[[Event], None]:
        def event(ev: Event) -> None:  # on the engine thread
            now = time.perf_counter()
            if ev.token is not None:
                r.tokens.append(ev.token)
                r.stamps.append(now)
                r.replays_at.append(r.ticket.stream.replays if r.ticket and r.ticket.stream else 0)
            if ev.finish:
                r.final, r.ended, r.ticket = ev, now, None
                slots.release()
        return event

    deadline = time.monotonic() + timeout_s
    last_start = time.monotonic() + (timeout_s if submit_s is None else submit_s)
    for i, n in enumerate(lengths):
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
        if time.monotonic() > last_start:
            slots.release()
            break
        r = Outcome(submitted=time.perf_counter())
        results.append(r)
        ticket = engine.submit(Request(prompts[i % len(prompts)], SamplingConfig(max_tokens=n), frozenset()), on(r))
        if r.final is None:  # (it may have ended already, on the engine thread)
            r.ticket = ticket
    for _ in range(concurrency):  # every request in flight ends (or the bound runs out)
        slots.acquire(timeout=max(0.0, deadline - time.monotonic()))
    return results


def latencies(results: list[Outcome]) -> dict[str, float]:
    ok = [r for r in results if r.final is not None and r.final.finish == "length"]
    e2e = [r.ended - r.submitted for r in ok]
    ttft = [r.stamps[0] - r.submitted for r in ok if r.stamps]
    return {"e2e_p50_ms": 1000 * pct(e2e, 50), "e2e_p99_ms": 1000 * pct(e2e, 99),
            "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99)}


def recovery(faults: list[Fault], results: list[Outcome]) -> dict[str, list[float]]:
    """Per fault, seconds from it to the first token after it: for a kill, the first token of a
    stream replayed since (tokens already on their way when it died do not count); for a hang,
    the first token after the worker was continued."""
    out: dict[str, list[float]] = {"kill": [], "hang": []}
    for f in faults:
        firsts = []
        for r in results:
            before = [n for t, n in zip(r.stamps, r.replays_at, strict=True) if t <= f.at]
            after = [(t, n) for t, n in zip(r.stamps, r.replays_at, strict=True) if t > f.at]
            if f.kind == "kill":
                firsts += [t for t, n in after if n > (before[-1] if before else 0)][:1]
            else:
                firsts += [t for t, _ in after if t > f.back][:1]
        if firsts:
            out[f.kind].append(min(firsts) - f.at)
    return out


def soak(engine: Engine, prompts: list[list[int]], workers: list[Worker],
         args: argparse.Namespace) -> dict[str, object]:
    """Steady load for `--soak-s` seconds with hangs only; RSS of every process and this process's
    threads sampled every `--sample-s`."""
    me = psutil.Process()
    samples: list[tuple[float, float, float, float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.perf_counter()
        while not stop.wait(args.sample_s):
            samples.append((time.perf_counter() - start, me.memory_info().rss / 2**20, *(w.rss_mb() for w in workers),
                            threading.active_count()))

    sampler = threading.Thread(target=sample, daemon=True)
    rng = random.Random(args.seed + 1)
    lengths = [rng.randint(16, 48) for _ in range(100_000)]
    with Faults(workers, args.soak_fault_every, (args.hang_min, args.hang_max), args.seed + 2,
                kinds=("hang",)) as faults:
        sampler.start()
        done = run_requests(engine, prompts, lengths, args.concurrency, args.soak_s + 300, submit_s=args.soak_s)
        stop.set()
        sampler.join()
    lost = sum(r.final is None or r.final.finish != "length" for r in done)
    # Each process's RSS first climbs to a high-water mark (allocator arenas of the threads each
    # new session starts, requests of an old session and a new one alive at once), then stays:
    # the slope over the second half is what a leak would show.
    late = samples[len(samples) // 2:] or samples
    figures: dict[str, object] = {"soak_s": args.soak_s, "soak_requests": len(done), "soak_lost": lost,
                                  "soak_hangs": len(faults.done), "soak_fault_every_s": args.soak_fault_every}
    for col, name in enumerate(("coordinator", "worker1", "worker2"), start=1):
        ys = [s[col] for s in samples]
        figures[f"{name}_rss_mb"] = [round(ys[0], 1), round(late[0][col], 1), round(ys[-1], 1)]  # start, half, end
        figures[f"{name}_rss_slope_mb_min"] = round(60 * _slope([s[0] for s in late], [s[col] for s in late]), 2)
        # A process that gives freed heap back (host.trim_memory_every) swings between a floor (what
        # is live) and a peak: a leak raises the floor from one fifth of the soak to the next.
        fifths = [ys[i * len(ys) // 5:(i + 1) * len(ys) // 5] or ys for i in range(5)]
        figures[f"{name}_rss_floor_mb"] = [round(min(f), 1) for f in fifths]
        figures[f"{name}_rss_peak_mb"] = [round(max(f), 1) for f in fifths]
    figures["threads"] = [samples[0][4], samples[-1][4]]
    if args.samples_csv:
        write_samples(args.samples_csv, samples)
    return figures


def write_samples(path: Path, samples: list[tuple[float, float, float, float, int]]) -> None:
    """The soak's RSS curve, one row per sample (atomic: temp then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    rows = ["t_s,coordinator_mb,worker1_mb,worker2_mb,threads"]
    rows += [f"{t:.1f},{c:.1f},{w1:.1f},{w2:.1f},{n}" for t, c, w1, w2, n in samples]
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(path)


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


class ReplayCauses(logging.Handler):
    """Counts the engine's replays by cause (a lost link, the watchdog, or state lost with a chain)."""

    def __init__(self) -> None:
        super().__init__()
        self.causes = {"link": 0, "watchdog": 0, "other": 0}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if " replayed on lease " in msg:
            cause = "watchdog" if "did not answer" in msg else "link" if "lost worker" in msg else "other"
            self.causes[cause] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--fault-every", type=float, help="mean seconds between faults (default 5, 3 with --quick)")
    ap.add_argument("--hang-min", type=float, default=0.5)
    ap.add_argument("--hang-max", type=float, default=3.0)
    ap.add_argument("--floor", type=float, default=1.0, help="watchdog floor, seconds")
    ap.add_argument("--multiple", type=float, default=20.0, help="watchdog multiple of the recent average")
    ap.add_argument("--soak-s", type=float, default=600.0)
    ap.add_argument("--soak-fault-every", type=float, default=2.0, help="mean seconds between hangs in the soak")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--samples-csv", type=Path, help="write the soak's RSS samples here")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="bound on each run of the requests")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="20 requests, a 30 s soak")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.soak_s, args.sample_s = 20, 30.0, 2.0
    args.fault_every = args.fault_every or (3.0 if args.quick else 5.0)
    quiet, load = wait_quiet(max_wait_s=0 if args.quick else 1200)
    folder = shard_folder(args.work, 3)
    tok = ChatTokenizer(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    rng = random.Random(args.seed)
    lengths = [rng.randint(16, 48) for _ in range(args.requests)]
    causes = ReplayCauses()
    logging.getLogger("shardline.engine").addHandler(causes)
    logging.getLogger("shardline.engine").propagate = False  # counted, not printed
    workers: list[Worker] = []
    try:
        workers = [Worker(folder, 1), Worker(folder, 2)]
        # f32 activations: the replayed prefill and the steps it replaces agree exactly
        serve = ServeConfig(max_streams=args.concurrency, max_queue=args.concurrency, decode_groups=1,
                            recovery=RecoveryConfig(args.floor, args.multiple))
        engine = open_serving(folder, serve=serve, workers=[w.addr for w in workers], activations="f32")[0]
        run_requests(engine, prompts, [8] * args.concurrency, args.concurrency, 300)  # warm-up
        clean = run_requests(engine, prompts, lengths, args.concurrency, args.timeout_s)
        with Faults(workers, args.fault_every, (args.hang_min, args.hang_max), args.seed) as faults:
            start = time.perf_counter()
            chaos = run_requests(engine, prompts, lengths, args.concurrency, args.timeout_s)
            chaos_s = time.perf_counter() - start
        replayed = dict(causes.causes)  # the soak's are counted apart
        soaked = soak(engine, prompts, workers, args)
        soaked["soak_replays"] = sum(causes.causes.values()) - sum(replayed.values())
        engine.shutdown()
    finally:
        for w in workers:
            w.stop()
    report(args, clean, chaos, chaos_s, faults.done, replayed, soaked, quiet, load)
    return 0


def report(args: argparse.Namespace, clean: list[Outcome], chaos: list[Outcome], chaos_s: float,
           faults: list[Fault], causes: dict[str, int], soaked: dict[str, object], quiet: bool, load: float) -> None:
    lost = [i for i, r in enumerate(chaos) if r.final is None or r.final.finish != "length"]
    lost += list(range(len(chaos), args.requests))  # never started: the time bound ran out
    differ = [i for i, (a, b) in enumerate(zip(clean, chaos, strict=False)) if i not in lost and a.tokens != b.tokens]
    errors = sorted({r.final.error for r in chaos if r.final is not None and r.final.error})
    lat = {"clean": latencies(clean), "chaos": latencies(chaos)}
    rec = recovery(faults, chaos)
    kills, hangs = (sum(f.kind == k for f in faults) for k in ("kill", "hang"))
    print(f"\n{args.requests} requests, {args.concurrency} at a time, 3 stages (2 worker processes); "
          f"{kills} kills and {hangs} hangs in {chaos_s:.0f} s; replays by cause: {causes}")
    print(f"{'run':>8} {'lost':>5} {'differ':>7} " + " ".join(f"{k:>12}" for k in lat["clean"]))
    for name, row in lat.items():
        print(f"{name:>8} {len(lost) if name == 'chaos' else 0:>5} {len(differ) if name == 'chaos' else '-':>7} "
              + " ".join(f"{v:12.0f}" for v in row.values()))
    for kind, xs in rec.items():
        if xs:
            print(f"{kind} -> first token after it: p50 {1000 * pct(xs, 50):.0f} ms, max {1000 * max(xs):.0f} ms "
                  f"({len(xs)} of {sum(f.kind == kind for f in faults)})")
    for e in errors:
        print(f"error: {e}")
    print("soak: " + ", ".join(f"{k} {v}" for k, v in soaked.items()))
    figures: dict[str, object] = {
        "chaos_over_clean_e2e_p50": round(lat["chaos"]["e2e_p50_ms"] / lat["clean"]["e2e_p50_ms"], 3),
        "chaos_over_clean_e2e_p99": round(lat["chaos"]["e2e_p99_ms"] / lat["clean"]["e2e_p99_ms"], 3),
        "lost": len(lost), "differ": len(differ), "requests": args.requests, "kills": kills, "hangs": hangs,
        "replays": causes, "kill_to_token_p50_ms": _ms(pct(rec["kill"], 50)),
        "kill_to_token_max_ms": _ms(max(rec["kill"], default=float("nan"))),
        "hang_to_token_p50_ms": _ms(pct(rec["hang"], 50)),
        "hang_to_token_max_ms": _ms(max(rec["hang"], default=float("nan"))),
        **{f"{run}_{k}": _ms(v / 1000) for run, row in lat.items() for k, v in row.items()},
        **soaked, "fault_every_s": args.fault_every, "hang_s": [args.hang_min, args.hang_max],
        "floor_s": args.floor, "multiple": args.multiple, "seed": args.seed, "quiet": quiet, "load": round(load, 2)}
    print(json.dumps(figures))


def _ms(seconds: float) -> float | None:
    """Milliseconds, rounded; None where there was nothing to measure (JSON has no NaN)."""
    return None if seconds != seconds else round(1000 * seconds, 1)


if __name__ == "__main__":
    sys.exit(main())
