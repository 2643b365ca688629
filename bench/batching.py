"""B streams in ONE infer call (batch B) against B InferRequests interleaved (batch 1 each).

Decode cost per token on the default model (SmolLM2-135M, gguf weights, exact precision), one
compiled 1-stage model for both ways, for B = 1, 2, 4, 8 at a context of ~64 and ~256 tokens,
with 2 threads and with 1 (a pipeline stage may get one core):
  interleave  B requests, each with its own KV state; a round runs each once (B infer calls)
  batch       one request whose state holds B rows; a round is one infer call with batch B.
              Rows have different lengths (row i has ctx - 3i prompt tokens): each row is
              left-padded with slots masked out (0) in its attention_mask row, its position_ids
              row counts its own tokens, beam_idx = arange(B). Filled by one padded prefill.
The check column compares each batched row's greedy tokens with the same stream run alone.

Also measured:
  join   a stream prefilled alone (batch 1) appended as a row of a batched request through
         query_state()/set_state (all rows are rewritten: OpenVINO sets a whole variable),
         at ~256 tokens; then a row dropped by leaving it out of beam_idx. Both checked by tokens.
  memory per open stream of a 2-stage export (one InferRequest per stage, KV for N tokens):
         RSS growth (a fresh process per case), as the runner leaves a request today and with
         its prefill-sized output tensor swapped for a decode-sized one; and the bytes of its
         query_state() tensors.

    python bench/batching.py              # 3 reps, 32 decode steps
    python bench/batching.py --quick      # 1 rep, 8 steps, B = 1, 4

The last line on stdout is one JSON object with the figures, ratios first. A ratio
"batchB_vs_interleaveB" is interleaved ms per token / batched ms per token: above 1 = batch faster.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import openvino as ov
from kit import TEXT, shard_folder  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer

Inputs = dict[str, np.ndarray]


def text_ids(folder: Path) -> list[int]:
    return ChatTokenizer(folder).encode(TEXT)


def prompts(ids: list[int], ctx: int, b: int) -> list[list[int]]:
    """B different prompts of different lengths: row i starts 5i tokens into the text, ctx - 3i long."""
    return [ids[5 * i: 5 * i + ctx - 3 * i] for i in range(b)]


def compile_stages(folder: Path, run: RunConfig) -> list[ov.CompiledModel]:
    core = ov.Core()
    return [core.compile_model(core.read_model(folder / e.xml), "CPU", run.ov_properties())
            for e in load_manifest(folder).stages]


def infer(request: ov.InferRequest, inputs: Inputs) -> np.ndarray:
    """Copied inputs, as StageRunner does (a request keeps its last input tensors set). A last
    stage (manifest format 2) also takes `logits_index`: the last position of every row here,
    so its output is [B, 1, vocab]."""
    if "logits_index" not in inputs and any(p.any_name == "logits_index" for p in request.model_inputs):
        b, t = inputs["position_ids"].shape
        inputs = inputs | {"logits_index": np.full((b, 1), t - 1, np.int64)}
    request.infer(inputs, share_inputs=False)
    return request.get_output_tensor(0).data


def single(ids: list[int], first: int) -> Inputs:
    """Batch-1 inputs for tokens `ids` at positions first.. over a fully attended cache."""
    t = len(ids)
    return {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, first + t), np.int64),
            "position_ids": np.arange(first, first + t, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}


# --- the two ways to decode B streams -------------------------------------------------------------


def interleaved(compiled: ov.CompiledModel, rows: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Seconds per decoded token, and each stream's greedy tokens (prefill's first, then `steps`)."""
    requests = [compiled.create_infer_request() for _ in rows]
    tokens = [[int(np.argmax(infer(r, single(p, 0))[0, -1]))] for r, p in zip(requests, rows, strict=True)]
    start = time.perf_counter()
    for d in range(steps):
        for r, p, toks in zip(requests, rows, tokens, strict=True):
            toks.append(int(np.argmax(infer(r, single(toks[-1:], len(p) + d))[0, -1])))
    return (time.perf_counter() - start) / (steps * len(rows)), tokens


@dataclass
class Batched:
    """One request holding B streams as rows; `mask` is every row's attention mask so far."""

    request: ov.InferRequest
    mask: np.ndarray  # [B, slots] i64
    positions: np.ndarray  # [B] the next logical position of each row
    tokens: list[list[int]]

    @classmethod
    def prefill(cls, compiled: ov.CompiledModel, rows: list[list[int]]) -> Batched:
        """One padded prefill: row i is left-padded to the longest row with slots masked out."""
        b, s = len(rows), max(map(len, rows))
        ids, mask, pos = (np.zeros((b, s), np.int64) for _ in range(3))
        for i, p in enumerate(rows):
            ids[i, s - len(p):], mask[i, s - len(p):], pos[i, s - len(p):] = p, 1, np.arange(len(p))
        request = compiled.create_infer_request()
        logits = infer(request, {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                 "beam_idx": np.arange(b, dtype=np.int32)})
        return cls(request, mask, np.array([len(p) for p in rows]), [[int(t)] for t in logits[:, -1].argmax(-1)])

    def step(self, beam: np.ndarray | None = None) -> None:
        """Decode one token for every row. `beam` (row indices) keeps only those rows: the
        Gather on every KV read drops the others, and the state shrinks to the rows kept."""
        if beam is not None:
            self.mask, self.positions = self.mask[beam], self.positions[beam]
            self.tokens = [self.tokens[i] for i in beam]
        b = len(self.tokens)
        self.mask = np.concatenate([self.mask, np.ones((b, 1), np.int64)], 1)
        logits = infer(self.request, {
            "input_ids": np.array([t[-1:] for t in self.tokens], np.int64), "attention_mask": self.mask,
            "position_ids": self.positions[:, None].astype(np.int64),
            "beam_idx": (np.arange(b) if beam is None else beam).astype(np.int32)})
        self.positions = self.positions + 1
        for toks, t in zip(self.tokens, logits[:, -1].argmax(-1), strict=True):
            toks.append(int(t))

    def join(self, solo: ov.InferRequest, length: int, first: int) -> dict[str, float]:
        """Append the stream held by a batch-1 request as a new last row. set_state replaces a
        whole variable, so every row is copied; if the newcomer is longer than the batch,
        every old row gets more left padding. Returns the seconds of each part."""
        t0 = time.perf_counter()
        own = {s.name: s.state.data.copy() for s in solo.query_state()}
        t1 = time.perf_counter()
        states = self.request.query_state()
        old = {s.name: s.state.data for s in states}
        t2 = time.perf_counter()
        b, slots = self.mask.shape
        width = max(slots, length)
        mask = np.zeros((b + 1, width), np.int64)
        mask[:b, width - slots:], mask[b, width - length:] = self.mask, 1
        new = {}
        for name, rows in old.items():
            new[name] = np.zeros((b + 1, rows.shape[1], width, rows.shape[3]), rows.dtype)
            new[name][:b, :, width - slots:], new[name][b, :, width - length:] = rows, own[name][0]
        t3 = time.perf_counter()
        for state in states:
            state.state = ov.Tensor(new[state.name])
        t4 = time.perf_counter()
        self.mask, self.positions = mask, np.append(self.positions, length)
        self.tokens.append([first])
        return {"read_new": t1 - t0, "read_batch": t2 - t1, "build": t3 - t2, "set": t4 - t3}


def batched(compiled: ov.CompiledModel, rows: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    run = Batched.prefill(compiled, rows)
    start = time.perf_counter()
    for _ in range(steps):
        run.step()
    return (time.perf_counter() - start) / (steps * len(rows)), run.tokens


def check(got: list[list[int]], alone: list[list[int]]) -> str:
    """'B/B' rows identical to their stream alone, else also the first differing (row, token)."""
    same = sum(g == a for g, a in zip(got, alone, strict=True))
    if same == len(alone):
        return f"{same}/{len(alone)}"
    row = next(i for i, (g, a) in enumerate(zip(got, alone, strict=True)) if g != a)
    at = next(k for k, (x, y) in enumerate(zip(got[row], alone[row], strict=False)) if x != y)
    return f"{same}/{len(alone)} (row {row} from token {at})"


# --- join and drop --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    ms: dict[str, float]  # read_new, read_batch (query_state), build (numpy), set (set_state), total
    check: str
    ok: bool


def join_and_drop(compiled: ov.CompiledModel, rows: list[list[int]], alone: list[list[int]], steps: int) -> Join:
    """rows[1:] prefilled as a batch, then rows[0] (the longest: every old row is re-padded)
    prefilled alone and joined; half the steps later the first row is dropped via beam_idx."""
    run = Batched.prefill(compiled, rows[1:])
    solo = compiled.create_infer_request()
    first = int(np.argmax(infer(solo, single(rows[0], 0))[0, -1]))
    parts = run.join(solo, len(rows[0]), first)
    del solo  # its KV now lives in the batch
    order = [*range(1, len(rows)), 0]  # the batch's rows, as stream indices
    for _ in range(steps // 2):
        run.step()
    run.step(beam=np.arange(1, len(order)))  # drop stream `order[0]`
    for _ in range(steps - steps // 2 - 1):
        run.step()
    want = [alone[i][: steps + 1] for i in order[1:]]
    ms = {k: v * 1e3 for k, v in parts.items()} | {"total": sum(parts.values()) * 1e3}
    return Join(ms, check(run.tokens, want), run.tokens == want)


# --- memory per stream ----------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def stream_memory(folder: str, ctx: int, streams: int, threads: int, precision: str,
                  shrink: bool) -> dict[str, float]:
    """Runs in a fresh process: RSS growth per open stream of a chain of stages, each stream
    prefilled with `ctx` tokens in one step and then decoding one token (a decoding stream).
    A request keeps the output tensor of its largest step: after a T-token prefill the last
    stage holds [1, T, vocab] f32 logits. `shrink` gives each request a decode-sized output
    tensor after its prefill, so that buffer is freed (what is then left is mostly the KV)."""
    path = Path(folder)
    compiled = compile_stages(path, RunConfig(precision=precision, threads=threads))
    ids = text_ids(path)
    ids = (ids * (ctx // len(ids) + 1))[:ctx]

    def chain(requests: list[ov.InferRequest], tokens: list[int], first: int) -> None:
        inputs = single(tokens, first)
        out = None
        for k, r in enumerate(requests):
            if k:
                inputs = {"hidden_states": out} | {n: v for n, v in inputs.items() if n != "input_ids"}
            out = infer(r, inputs)

    def open_stream() -> list[ov.InferRequest]:
        requests = [c.create_infer_request() for c in compiled]
        chain(requests, ids, 0)
        if shrink:
            for r in requests:
                shape = r.get_output_tensor(0).shape
                r.set_output_tensor(0, ov.Tensor(np.zeros((shape[0], 1, *shape[2:]), np.float32)))
        chain(requests, [ids[-1]], ctx)
        return requests

    # Warm-up: the first run of each shape allocates the graphs' scratch memory, shared by all
    # requests. The first stream measured after it reuses memory the warm-up stream freed, so the
    # figure is the growth from stream 1 to stream K, divided by K - 1.
    warm = open_stream()
    del warm
    gc.collect()
    held, rss = [], []
    for _ in range(streams):
        held.append(open_stream())
        rss.append(rss_mb())
    state = sum(s.state.data.nbytes for r in held[0] for s in r.query_state())
    return {"rss_per_stream_mb": (rss[-1] - rss[0]) / (streams - 1), "state_mb": state / 2**20,
            "kv_bytes_per_token": state / (ctx + 1)}


# --- driver ---------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--contexts", default="64,256")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per stream")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", default="exact", choices=("exact", "fast", "plugin"))
    p.add_argument("--memory-contexts", default="256,1024", help="\"\" skips the memory part")
    p.add_argument("--memory-streams", type=int, default=4, help="streams opened per case (at least 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 rep, 8 steps, B = 1, 4")
    args = p.parse_args()
    if args.quick:
        args.reps, args.steps, args.batches = 1, 8, "1,4"
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    thread_counts = [int(x) for x in args.threads.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    one, two = shard_folder(args.work, 1), shard_folder(args.work, 2)
    ids = text_ids(one)
    if max(contexts) + 5 * (max(batches) - 1) > len(ids):
        p.error(f"the text has {len(ids)} tokens: contexts up to {len(ids) - 5 * (max(batches) - 1)}")

    # Memory first, each case in a fresh process: nothing else allocated yet.
    memory: dict[int, dict[str, float]] = {}
    spawn = get_context("spawn")
    for ctx in (int(x) for x in args.memory_contexts.split(",") if x):  # "" skips the memory part
        for shrink in (False, True):
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                m = pool.submit(stream_memory, str(two), ctx, args.memory_streams, thread_counts[0],
                                args.precision, shrink).result()
            memory.setdefault(ctx, {}).update(m if not shrink else {"rss_per_stream_mb_shrunk": m["rss_per_stream_mb"]})
        print(f"memory ctx {ctx}: {memory[ctx]}", file=sys.stderr)

    # Decode: per (threads, ctx, B), reps interleaved across ways and B so that noise hits all.
    times: dict[tuple[int, int, int, str], list[float]] = {}
    checks: dict[tuple[int, int, int], str] = {}
    joins: dict[tuple[int, int], list[Join]] = {}
    for threads in thread_counts:
        (compiled,) = compile_stages(one, RunConfig(precision=args.precision, threads=threads))
        ways: dict[str, Callable[[ov.CompiledModel, list[list[int]], int], tuple[float, list[list[int]]]]] = {
            "interleave": interleaved, "batch": batched}
        interleaved(compiled, prompts(ids, 16, 2), 2)  # warm-up: first-inference allocations
        batched(compiled, prompts(ids, 16, 2), 2)
        for rep in range(args.reps):
            for ctx in contexts:
                for b in batches:
                    rows = prompts(ids, ctx, b)
                    out: dict[str, list[list[int]]] = {}
                    for name in (ways if rep % 2 == 0 else reversed(ways)):
                        s, out[name] = ways[name](compiled, rows, args.steps)
                        times.setdefault((threads, ctx, b, name), []).append(s * 1e3)
                    got = check(out["batch"], out["interleave"])
                    if checks.get((threads, ctx, b), got) != got:
                        got = f"{got} (rep {rep + 1}; was {checks[threads, ctx, b]})"
                    checks[threads, ctx, b] = got
                    if b > 1 and ctx == max(contexts):
                        joins.setdefault((threads, b), []).append(
                            join_and_drop(compiled, rows, out["interleave"], args.steps))
                    print(f"rep {rep + 1}/{args.reps} threads {threads} ctx {ctx} B {b}: "
                          f"interleave {times[threads, ctx, b, 'interleave'][-1]:.2f} "
                          f"batch {times[threads, ctx, b, 'batch'][-1]:.2f} ms/token, check {got}",
                          file=sys.stderr)
        del compiled
        gc.collect()

    ms = {k: median(v) for k, v in times.items()}
    print(f"\nSmolLM2-135M gguf, {args.precision} precision, 1 stage; {args.steps} decode steps per "
          f"stream; row i has ctx - 3i prompt tokens; median of {args.reps}; load average {load:.1f} at start")
    print("speedup = interleaved ms/token / batched ms/token, per rep (the two ran back to back), median")
    print(f"{'threads':>7} {'ctx':>4} {'B':>2} {'interleave ms/tok':>18} {'batch ms/tok':>13} "
          f"{'batch ms/call':>14} {'speedup':>8}  check (batched rows = alone)")
    ratios: dict[str, float] = {}
    fits: dict[str, dict[str, float]] = {}
    for threads in thread_counts:
        for ctx in contexts:
            for b in batches:
                i, bt = ms[threads, ctx, b, "interleave"], ms[threads, ctx, b, "batch"]
                # Paired per rep: a noisy moment on the shared machine hits both ways of that rep.
                paired = median([x / y for x, y in zip(times[threads, ctx, b, "interleave"],
                                                       times[threads, ctx, b, "batch"], strict=True)])
                ratios[f"batch{b}_vs_interleave{b}_ctx{ctx}_t{threads}"] = round(paired, 3)
                print(f"{threads:>7} {ctx:>4} {b:>2} {i:>18.2f} {bt:>13.2f} {bt * b:>14.2f} {paired:>8.2f}  "
                      f"{checks[threads, ctx, b]}")
            # Cost of one batched call as fixed + per row (least squares over B): what a batch shares.
            xs = np.array(batches, float)
            per_row, fixed = np.polyfit(xs, np.array([ms[threads, ctx, b, "batch"] * b for b in batches]), 1)
            fits[f"ctx{ctx}_t{threads}"] = {"fixed_ms": round(float(fixed), 2), "per_row_ms": round(float(per_row), 2)}
    print("\none batched call, least-squares fit over B: ms = fixed + per_row * B")
    for key, f in fits.items():
        print(f"  {key}: fixed {f['fixed_ms']:.1f} ms + {f['per_row_ms']:.2f} ms per row")
    print("\njoin a stream prefilled alone into a batch (set_state), then drop a row (beam_idx); "
          f"ctx {max(contexts)}")
    parts = ("read_new", "read_batch", "build", "set", "total")
    print(f"{'threads':>7} {'B after join':>12} " + " ".join(f"{k + ' ms':>13}" for k in parts) + "  tokens")
    join_fig: dict[str, dict[str, object]] = {}
    for (threads, b), runs in joins.items():
        med = {k: median([r.ms[k] for r in runs]) for k in parts}
        ok = sum(r.ok for r in runs)
        print(f"{threads:>7} {b:>12} " + " ".join(f"{med[k]:>13.2f}" for k in parts) + f"  {ok}/{len(runs)} ok"
              + ("" if ok == len(runs) else f"  {runs[0].check}"))
        join_fig[f"B{b}_t{threads}"] = {**{f"{k}_ms": round(v, 2) for k, v in med.items()}, "ok_runs": ok,
                                        "runs": len(runs)}
    print("\nmemory per open stream, 2-stage export (one request per stage), N-token prefill + 1 decode step")
    print(f"{'N':>5} {'RSS MB/stream':>14} {'... output shrunk':>18} {'state MB (query_state)':>23} {'KV B/token':>11}")
    for ctx, m in memory.items():
        print(f"{ctx:>5} {m['rss_per_stream_mb']:>14.1f} {m['rss_per_stream_mb_shrunk']:>18.1f} "
              f"{m['state_mb']:>23.1f} {m['kv_bytes_per_token']:>11.0f}")

    headline = {f"batch{b}_vs_interleave{b}_decode": ratios[f"batch{b}_vs_interleave{b}_ctx{max(contexts)}"
                                                            f"_t{thread_counts[0]}"] for b in batches if b > 1}
    figures: dict[str, object] = {
        **headline, **ratios,
        "headline_is": f"ctx {max(contexts)}, threads {thread_counts[0]}",
        "ms_per_token": {f"{w}_B{b}_ctx{c}_t{t}": round(v, 3) for (t, c, b, w), v in ms.items()},
        "checks": {f"B{b}_ctx{c}_t{t}": v for (t, c, b), v in checks.items()},
        "batched_call_fit": fits,
        "join": join_fig,
        "memory": {str(c): {k: round(v, 2) for k, v in m.items()} for c, m in memory.items()},
        "precision": args.precision, "steps": args.steps, "reps": args.reps, "load_avg_1m_at_start": round(load, 2),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
