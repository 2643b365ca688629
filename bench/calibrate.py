"""Calibrate the disaggregation simulator's costs on THIS machine (issue 13, point 10): measure what
a prefill chunk, a decode group's step and a KV transfer cost, fit `Costs.fit` to the samples,
show how well the fitted model reproduces every one of them, and save it (`Costs.to_json`).

The default model's stateful export (`default_shards(paged=False)`: 2 balanced stages, gguf) in this process
(LocalPipeline, every stage on its own thread) with the serving run config (`RunConfig()`: exact
precision, OpenVINO's thread default), as `shardline serve` runs it. Every time is the wall time
from submitting a step (or an export / import) to its result, what the engine waits for. Prompts
are a plain English text repeated to the length needed. One stream prefilled in 128-token chunks
(the engine's chunk) is exported at every length a part needs; a part imports those snapshots
instead of prefilling again.

(a) prefill: a chunk of n positions (default 16-256) after c cached tokens (default 0, 512, 1024,
    2048), not the prompt's last (no token sampled; the last chunk adds one lm_head row). For
    c > 0 the stream's c - 1 tokens are imported and one more token prefilled (untimed) first, so
    the timed chunk is not the first inference of a fresh request (as in the engine, where only
    a prompt's first chunk is). Reps interleave the cells; the first rep is a warm-up.
(b) decode: a decode group of R rows (default 1, 2, 4, 8) built as the engine builds one: every
    row prefilled alone (row i 3i tokens shorter than row 0, the last chunk sampling its first
    token), then one step merging them all into the group's state, left-padded to the widest
    (serving/groups.py); then steps of one token per row. All groups are built first, then each
    round steps every group once (so noise hits all); the first --warm steps of each group are
    not counted. The widest row attends over c (default 64, 512, 1024, 2048) positions at the
    median timed step: the simulator's `decode_s(R, c)` charges the widest row's context.
(c) transfer: a stream of n tokens (default 64-4096) exported from every stage (`export_kv`)
    plus the snapshot imported into a fresh key (`import_kv`), against the snapshot's bytes.
    In process: no wire (what a link adds is not in these figures). First rep a warm-up.

(d) regrouping: on every group of (b) after its counted steps, one step that merges a fresh row
    (prefilled alone as in (b)) into all its rows, as the engine's join does, then one step that
    drops row 0, as a departure does; each timed once, whole. What they add over a plain step of
    the same rows and width (from the decode fit) is fitted as bytes of the state per second.

Medians of the counted reps. Then `Costs.fit` (least squares, every coefficient >= 0) over all
the medians; a table of every sample measured against fitted (relative error, marked * past 15%),
and the fitted costs written atomically to --out.

    python bench/calibrate.py --quick                  # smoke run, under a minute
    python bench/quiet.py && python bench/calibrate.py # the calibration (a few minutes)
    python bench/calibrate.py --out /tmp/costs.json
    python bench/calibrate.py --shards ~/.cache/shardline/bench-big-model/big-32L-1stage --precision fast \
        --chunks 16,64,128 --prefill-contexts 0,512,1024 --rows 1,2,4 --decode-contexts 64,512,1024 \
        --transfer-tokens 64,256,1024 --reps 3 --steps 6 --warm 2 --out /tmp/costs-8b.json   # an 8B-class export

The last line on stdout is one JSON object: max and median relative fit error per kind first,
then the fitted coefficients, then the measured medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import count
from pathlib import Path

import numpy as np
from kit import shard_folder, text_ids, wait_quiet  # bench/ is on sys.path when this script runs
from shardline_tools.sim.costs import Costs

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig, SamplingParams
from shardline.export.defaults import default_shards
from shardline.pipeline.kv import KvSnapshot
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import DecodeStep, Outcome, Step, export_kv, import_kv, prefill, run
from shardline.stage.cache import KVBook, StepInputs

GREEDY = SamplingParams()
WAIT_S = 600.0
MISS = 0.15  # issue 13's bar for the simulator: a sample fitted worse than this is marked
SPACING = 3  # row i of a decode group is SPACING * i tokens shorter than row 0
KEYS = count(1)  # every stream, group and import gets a key never used before


def book_of(ids: list[int], n: int) -> KVBook:
    """The book of a stream holding its first n tokens, all attended (an imported snapshot)."""
    book = KVBook()
    book.commit(book.plan(ids[:n]))
    return book


def timed(pipe: LocalPipeline, step: Step) -> tuple[float, list[Outcome]]:
    start = time.perf_counter()
    outs = run(pipe, step, WAIT_S)
    seconds = time.perf_counter() - start
    if bad := [o for o in outs if o.failed]:
        raise SystemExit(f"a {step.phase.value} step of key {step.key} failed: {bad[0].error}")
    return seconds, outs


def snapshots(pipe: LocalPipeline, ids: list[int], lengths: set[int]) -> dict[int, KvSnapshot]:
    """One stream prefilled in the engine's chunks, exported at each of `lengths` on the way."""
    key, book, snaps = next(KEYS), KVBook(), {}
    for n in sorted(lengths):
        while book.position < n:
            start = book.position
            end = min(n, start + DEFAULT_PREFILL_CHUNK)
            timed(pipe, prefill(key, book, ids[start:end], GREEDY, first=start == 0, last=False))
        snaps[n] = export_kv(pipe, key).result(WAIT_S)
    pipe.release(key)
    return snaps


def opened(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], n: int) -> tuple[int, KVBook]:
    """A fresh key holding the stream's first n tokens (imported), and its book."""
    key = next(KEYS)
    import_kv(pipe, key, snaps[n]).result(WAIT_S)
    return key, book_of(ids, n)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def iqr(xs: list[float]) -> float:
    """Interquartile range over the median: how steady a sample's reps were."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / med(xs)


# --- (a) prefill ----------------------------------------------------------------------------------


def part_prefill(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], chunks: list[int],
                 contexts: list[int], reps: int) -> dict[tuple[int, int], list[float]]:
    """(n, c) -> seconds of each counted rep of an n-position chunk after c cached tokens."""
    cells = [(n, c) for c in contexts for n in chunks]
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for rep in range(reps + 1):  # rep 0 warms every shape up
        for n, c in cells if rep % 2 else reversed(cells):
            if c:
                key, book = opened(pipe, ids, snaps, c - 1)
                timed(pipe, prefill(key, book, ids[c - 1:c], GREEDY, first=False, last=False))
            else:
                key, book = next(KEYS), KVBook()
            seconds, _ = timed(pipe, prefill(key, book, ids[c:c + n], GREEDY, first=c == 0, last=False))
            pipe.release(key)
            if rep:
                times[n, c].append(seconds)
        print(f"prefill rep {rep}/{reps} done", file=sys.stderr, flush=True)
    return times


# --- (b) decode -----------------------------------------------------------------------------------


@dataclass
class Group:
    """A decode group as the engine holds one: a key for its state, a book and a token per row."""

    key: int
    streams: tuple[int, ...]
    books: list[KVBook]
    tokens: list[int]
    widths: list[int] = field(default_factory=list)  # each counted step's mask width (the widest row)
    times: list[float] = field(default_factory=list)

    def step(self, pipe: LocalPipeline, merge: bool = False, join: Row | None = None,
             drop: int | None = None) -> tuple[float, int]:
        """One token per row, as Group.launch plans it (every book left-padded to the widest):
        `merge` makes the rows' own states the group's first (its first step); `join` merges
        one more row's own state into all the kept rows; `drop` leaves that row out (beam_idx)."""
        keep: tuple[int, ...] = ()
        if join is not None:
            keep = tuple(range(len(self.streams)))
            self.streams, self.books, self.tokens = (*self.streams, join.key), [*self.books, join.book], \
                [*self.tokens, join.token]
        elif drop is not None:
            keep = tuple(r for r in range(len(self.streams)) if r != drop)
            self.streams = tuple(self.streams[r] for r in keep)
            self.books, self.tokens = [self.books[r] for r in keep], [self.tokens[r] for r in keep]
        width = max(b.slots for b in self.books)
        for b in self.books:
            b.pad_left(width - b.slots)
        beam_idx = np.asarray(keep, np.int32) if drop is not None else None
        inputs = StepInputs.stack([b.plan([t]) for b, t in zip(self.books, self.tokens, strict=True)], beam_idx)
        for r, b in enumerate(self.books):
            b.commit(inputs, r)
        rows = len(self.streams)
        at = np.array([[r, 0] for r in range(rows)], np.int64)
        merged = self.streams if merge else (join.key,) if join is not None else ()
        step = DecodeStep(self.key, self.streams, (GREEDY,) * rows, inputs, at, keep=keep, merge=merged)
        seconds, outs = timed(pipe, step)
        self.tokens = [o.choices[0].token for o in outs]
        return seconds, int(inputs.attention_mask.shape[1])


@dataclass(frozen=True)
class Row:
    """A stream prefilled alone, its first token sampled: what joins a group."""

    key: int
    book: KVBook
    token: int


def row(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], base: int, length: int) -> Row:
    """An imported base, then the row's own last chunk up to `length` tokens (it samples the first)."""
    key, book = opened(pipe, ids, snaps, base)
    _, (out,) = timed(pipe, prefill(key, book, ids[base:length], GREEDY, first=False, last=True))
    return Row(key, book, out.choices[0].token)


def longest_row(context: int, warm: int, steps: int) -> int:
    """Row 0's prompt length such that the median counted step's mask is `context` wide: the
    merge step is L + 1 wide, the warm-up steps L + 2 .., the counted ones L + 2 + warm .."""
    return context - 2 - warm - (steps - 1) // 2


def decode_base(context: int, warm: int, steps: int, max_rows: int) -> int:
    """What every row of the groups at `context` imports before its own last chunk (>= 1 token)."""
    return longest_row(context, warm, steps) - SPACING * (max_rows - 1) - 1


def build(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], rows: int, context: int,
          warm: int, steps: int, max_rows: int) -> Group:
    """Rows prefilled alone (an imported base, then each row's own last chunk, which samples its
    first token), then the merge step that makes them one group (not counted)."""
    longest, base = longest_row(context, warm, steps), decode_base(context, warm, steps, max_rows)
    made = [row(pipe, ids, snaps, base, longest - SPACING * i) for i in range(rows)]
    group = Group(-next(KEYS), tuple(r.key for r in made), [r.book for r in made], [r.token for r in made])
    group.step(pipe, merge=True)
    return group


def part_decode(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], rows: list[int],
                contexts: list[int], warm: int, steps: int) -> dict[tuple[int, int], Group]:
    groups = {(r, c): build(pipe, ids, snaps, r, c, warm, steps, max(rows)) for c in contexts for r in rows}
    print(f"decode: {len(groups)} groups built", file=sys.stderr, flush=True)
    order = list(groups.values())
    for k in range(warm + steps):
        for g in order if k % 2 else reversed(order):
            seconds, width = g.step(pipe)
            if k >= warm:
                g.times.append(seconds)
                g.widths.append(width)
    return groups


# --- (d) regrouping -------------------------------------------------------------------------------


def part_regroup(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot],
                 groups: dict[tuple[int, int], Group], warm: int, steps: int,
                 max_rows: int) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """On every decode group after its counted steps: one step that merges a fresh row into all
    its rows (an engine's join), then one that drops row 0 (a departure), each timed whole, as
    (rows of the state after it, its width, seconds); then the groups are released."""
    merges, drops = [], []
    for (r, c), g in groups.items():
        longest, base = longest_row(c, warm, steps), decode_base(c, warm, steps, max_rows)
        seconds, width = g.step(pipe, join=row(pipe, ids, snaps, base, longest - SPACING * (r - 1)))
        merges.append((len(g.streams), width, seconds))
        seconds, width = g.step(pipe, drop=0)
        drops.append((len(g.streams), width, seconds))
        pipe.release(g.key)
    print(f"regroup: {len(merges)} merges and drops timed", file=sys.stderr, flush=True)
    return merges, drops


# --- (c) transfer ---------------------------------------------------------------------------------


def part_transfer(pipe: LocalPipeline, ids: list[int], snaps: dict[int, KvSnapshot], lengths: list[int],
                  reps: int) -> dict[int, dict[str, list[float]]]:
    """n -> export, import and export + import seconds of each counted rep."""
    times: dict[int, dict[str, list[float]]] = {n: {"export": [], "import": [], "both": []} for n in lengths}
    for rep in range(reps + 1):  # rep 0 warms up
        for n in lengths if rep % 2 else reversed(lengths):
            key, _ = opened(pipe, ids, snaps, n)
            to = next(KEYS)
            start = time.perf_counter()
            snap = export_kv(pipe, key).result(WAIT_S)
            mid = time.perf_counter()
            import_kv(pipe, to, snap).result(WAIT_S)
            end = time.perf_counter()
            pipe.release(key)
            pipe.release(to)
            if rep:
                for part, s in (("export", mid - start), ("import", end - mid), ("both", end - start)):
                    times[n][part].append(s)
        print(f"transfer rep {rep}/{reps} done", file=sys.stderr, flush=True)
    return times


# --- fit and report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    kind: str
    label: str  # also its key in the JSON line
    what: str  # the inputs, as printed
    measured_s: float
    fitted_s: float
    spread: float  # interquartile range / median of its reps

    @property
    def error(self) -> float:
        """Signed relative error of the fit: (fitted - measured) / measured."""
        return (self.fitted_s - self.measured_s) / self.measured_s


def parse(ints: str) -> list[int]:
    return [int(x) for x in ints.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/shardline-bench/costs.json"))
    ap.add_argument("--chunks", default="16,32,64,128,192,256", help="prefill chunk sizes")
    ap.add_argument("--prefill-contexts", default="0,512,1024,2048", help="cached tokens before a chunk")
    ap.add_argument("--rows", default="1,2,4,8", help="decode group rows")
    ap.add_argument("--decode-contexts", default="64,512,1024,2048", help="widest row's positions")
    ap.add_argument("--transfer-tokens", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=11, help="counted reps of a prefill chunk and of a transfer")
    ap.add_argument("--steps", type=int, default=41, help="counted decode steps per group")
    ap.add_argument("--warm", type=int, default=4, help="decode steps per group not counted")
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine")
    ap.add_argument("--stages", type=int, default=0,
                    help="calibrate a gguf export of this many stages (under --work); 0: the default export")
    ap.add_argument("--shards", type=Path, help="calibrate this export folder instead (big_model.py's 8B-class one)")
    ap.add_argument("--precision", default="exact", choices=("exact", "fast"), help="the stages' precision")
    ap.add_argument("--threads", type=int, help="OpenVINO threads per stage (default: the plugin's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: fewer cells (chunks 16,128; contexts 0,512; rows 1,4 at 64,512; "
                         "64-1024 tokens), 2 reps, 5 steps, no wait")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.prefill_contexts, args.rows, args.decode_contexts = "16,128", "0,512", "1,4", "64,512"
        args.transfer_tokens, args.reps, args.steps, args.warm, args.max_wait = "64,256,1024", 2, 5, 1, 0
    chunks, p_contexts, rows = parse(args.chunks), parse(args.prefill_contexts), parse(args.rows)
    d_contexts, t_lengths = parse(args.decode_contexts), parse(args.transfer_tokens)
    if args.reps < 1 or args.steps < 1 or args.warm < 0 or not (chunks and p_contexts and rows and d_contexts
                                                                   and t_lengths):
        ap.error("every list needs a value; --reps and --steps >= 1, --warm >= 0")
    if min(chunks + rows + t_lengths) < 1 or min(p_contexts) < 0:
        ap.error("chunks, rows and transfer tokens must be >= 1, contexts >= 0")
    if min(decode_base(c, args.warm, args.steps, max(rows)) for c in d_contexts) < 1:
        ap.error("a decode context is too small for these rows and steps (row 0 is ~context - warm - steps/2 "
                 f"long, row {max(rows) - 1} {SPACING * (max(rows) - 1)} tokens shorter)")

    quiet, load = wait_quiet(max_wait_s=args.max_wait)
    began = time.perf_counter()
    if args.shards is not None:
        folder = args.shards
    else:
        folder = shard_folder(args.work, args.stages) if args.stages else default_shards(progress=False, paged=False)
    run_cfg = RunConfig(precision=args.precision, threads=args.threads)
    lengths = ({c - 1 for c in p_contexts if c} | set(t_lengths)
               | {decode_base(c, args.warm, args.steps, max(rows)) for c in d_contexts})
    ids = text_ids(folder, max([*lengths, *(c + max(chunks) for c in p_contexts)]))
    with LocalPipeline(folder, run_cfg) as pipe:
        snaps = snapshots(pipe, ids, lengths)
        print(f"snapshots at {sorted(lengths)} tokens ready ({time.perf_counter() - began:.0f} s)",
              file=sys.stderr, flush=True)
        p_times = part_prefill(pipe, ids, snaps, chunks, p_contexts, args.reps)
        groups = part_decode(pipe, ids, snaps, rows, d_contexts, args.warm, args.steps)
        merges, drops = part_regroup(pipe, ids, snaps, groups, args.warm, args.steps, max(rows))
        t_times = part_transfer(pipe, ids, snaps, t_lengths, args.reps)
    kv_per_token = {n: snaps[n].nbytes / n for n in t_lengths}
    per_token = round(statistics.median(kv_per_token.values()))
    elapsed = time.perf_counter() - began

    p_samples = [(n, c, med(v)) for (n, c), v in p_times.items()]
    d_cells = {(r, int(med(g.widths))): g for (r, _), g in groups.items()}  # the widths measured
    d_samples = [(r, c, med(g.times)) for (r, c), g in d_cells.items()]
    t_samples = [(snaps[n].nbytes, med(v["both"])) for n, v in t_times.items()]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"bench/calibrate.py, {stamp}, {socket.gethostname()} ({os.cpu_count()} CPUs, "
              f"{'quiet' if quiet else 'NOT quiet'}, load {load:.2f}): {folder.name} in process, {run_cfg}; "
              f"medians of {args.reps} reps ({args.steps} decode steps); least squares over "
              f"{len(p_samples)} prefill, {len(d_samples)} decode, {len(t_samples)} transfer samples "
              f"(export + import in process, no wire)")
    # What a merge or a drop adds over a plain step of the same rows and width (the decode fit).
    plain = Costs.fit(p_samples, d_samples, t_samples, kv_bytes_per_token=per_token)
    m_samples = [(per_token * r * w, s - plain.decode_s(r, w)) for r, w, s in merges]
    x_samples = [(per_token * r * w, s - plain.decode_s(r, w)) for r, w, s in drops]
    costs = Costs.fit(p_samples, d_samples, t_samples, m_samples, x_samples, kv_bytes_per_token=per_token,
                      source=source + f", {len(merges)} merges and {len(drops)} drops")

    samples = [Sample("prefill", f"n{n}_c{c}", f"n={n:>4} c={c:>5}", s, costs.prefill_s(n, c), iqr(p_times[n, c]))
               for n, c, s in p_samples]
    samples += [Sample("decode", f"r{r}_c{c}", f"R={r:>4} c={c:>5}", s, costs.decode_s(r, c),
                       iqr(d_cells[r, c].times)) for r, c, s in d_samples]
    samples += [Sample("transfer", f"t{n}", f"{n:>5} tok {b / 1e6:>6.1f} MB", s, costs.transfer_s(b),
                       iqr(t_times[n]["both"])) for (b, s), n in zip(t_samples, t_lengths, strict=True)]
    samples += [Sample("merge", f"r{r}_w{w}", f"R={r:>4} w={w:>5}", s, costs.decode_s(r, w) + costs.merge_s(r, w), 0.0)
                for r, w, s in merges]
    samples += [Sample("drop", f"r{r}_w{w}", f"R={r:>4} w={w:>5}", s, costs.decode_s(r, w) + costs.drop_s(r, w), 0.0)
                for r, w, s in drops]

    print(f"\n{folder.name}, in process, {run_cfg}; medians of {args.reps} reps "
          f"(decode: {args.steps} steps after {args.warm}); {'quiet' if quiet else 'NOT quiet'} machine "
          f"(load {load:.2f} at start); {elapsed:.0f} s")
    print("prefill: n positions after c cached; decode: R rows, the widest attending over c; "
          "transfer: export + import; merge / drop: a step joining a row to R - 1 / leaving R of w slots")
    print(f"{'kind':<9} {'sample':<20} {'measured ms':>12} {'fitted ms':>10} {'error':>8} {'IQR':>6}")
    for s in samples:
        mark = " *" if abs(s.error) > MISS else ""
        print(f"{s.kind:<9} {s.what:<20} {1e3 * s.measured_s:>12.2f} {1e3 * s.fitted_s:>10.2f} "
              f"{100 * s.error:>+7.1f}% {100 * s.spread:>5.0f}%{mark}")
    print(f"* fitted more than {MISS:.0%} off; IQR = interquartile range of the reps / median")
    print("\nfitted (least squares, every term >= 0):")
    print(f"  prefill  {1e3 * costs.prefill_base_s:.2f} ms + {1e3 * costs.prefill_token_s:.3f} ms x n "
          f"+ {1e6 * costs.prefill_token_ctx_s:.3f} us x n x c")
    print(f"  decode   {1e3 * costs.decode_base_s:.2f} ms + {1e3 * costs.decode_row_s:.3f} ms x R "
          f"+ {1e6 * costs.decode_row_ctx_s:.3f} us x R x c")
    print(f"  transfer {1e3 * costs.transfer_latency_s:.2f} ms + bytes / {costs.transfer_bytes_per_s / 1e9:.2f} GB/s")
    print(f"  a step merging a row adds state bytes / {costs.merge_bytes_per_s / 1e9:.3f} GB/s; "
          f"dropping one, state bytes / {costs.drop_bytes_per_s / 1e9:.3f} GB/s")
    print("  (export / import ms alone, by tokens: "
          + ", ".join(f"{n}: {1e3 * med(v['export']):.1f} / {1e3 * med(v['import']):.1f}" for n, v in t_times.items())
          + ")")
    print(f"  KV {per_token} bytes per token (snapshot bytes / tokens: "
          f"{min(kv_per_token.values()):.0f}-{max(kv_per_token.values()):.0f})")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    costs.to_json(args.out)
    print(f"written to {args.out}")

    figures: dict[str, object] = {}
    for kind in ("prefill", "decode", "transfer", "merge", "drop"):
        errs = [abs(s.error) for s in samples if s.kind == kind]
        figures[f"{kind}_max_err"] = round(max(errs), 4)
        figures[f"{kind}_median_err"] = round(statistics.median(errs), 4)
    figures["missed_over_15pct"] = [f"{s.kind}_{s.label}" for s in samples if abs(s.error) > MISS]
    figures |= {k: v for k, v in asdict(costs).items() if k != "source"}
    figures["measured_ms"] = {f"{s.kind}_{s.label}": round(1e3 * s.measured_s, 3) for s in samples}
    figures["fitted_ms"] = {f"{s.kind}_{s.label}": round(1e3 * s.fitted_s, 3) for s in samples}
    figures |= {"export_ms": {str(n): round(1e3 * med(v["export"]), 3) for n, v in t_times.items()},
                "import_ms": {str(n): round(1e3 * med(v["import"]), 3) for n, v in t_times.items()},
                "reps": args.reps, "steps": args.steps, "warm": args.warm, "quiet": quiet, "load": round(load, 2),
                "seconds": round(elapsed), "out": str(args.out), "export": folder.name}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
