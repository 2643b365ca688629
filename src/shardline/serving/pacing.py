"""How much of a prompt the next chunk takes while other streams decode (no stutter).

A prompt chunk runs between two decode steps of every running stream at each stage it crosses,
so its time is a gap in their tokens. At a long context a fixed 128-token chunk costs 0.4-0.9 s
of attention on 2 cores against a ~20 ms decode step (BENCHMARKS.md, prefill): running streams
stalled for 30-50 steps at a time. Two rules bound that (Sarathi-Serve's token budget per
iteration, in time rather than tokens, since attention's cost grows with the context):

- budget: while streams decode, one chunk takes at most `budget` times their step time, so the
  longest gap it adds is about that; its size in tokens comes from a cost model of chunks fitted
  online to the chunks run so far (`ChunkCosts`), at the prompt's current context;
- share: prefill gets at most `share` of the stages' time while streams decode. Counted in
  graph seconds over the latest steps (decayed), whatever the decode batch's width: while the
  chunks' share of it is past `share`, no chunk is planned; a decode step or two later it is
  under again and the next chunk goes. So prefill always moves, and a prompt finishes within
  about its idle prefill time / share, plus the chunks' own fixed costs (BENCHMARKS.md, issue 23).

A short prompt (at most `short` tokens left: a chat turn, an agent's call) is not paced at all:
its chunks go at full size at once, and their time is not counted in prefill's share. The rules
above exist to bound what a long prompt does to running streams; under steady load of ordinary
requests they starved admission instead (issue 35: at 4 users each prompt waited 20-60 decode
steps for its share, so fewer streams decoded at once and throughput halved).

With nothing decoding, prefill runs at the full chunk size. Pure: the engine reports what steps
cost (their outcomes' timings), the scheduler asks for chunk sizes; tested with made-up seconds.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

from shardline.config import PacingConfig

MIN_CHUNK = 1  # tokens: a chunk past its budget is still one token (at a long context, one token is costly)
EXPLORE = 16  # tokens of a chunk while the cost model cannot tell a chunk's fixed cost from its tokens'
SAMPLES = 12  # chunks of each size class (a power of 2) the cost model is fitted on, the latest
SMOOTH = 0.2  # weight of a new decode step time in its running average
FORGET = 0.85  # what is left of the time counted so far at each decode step (the share over ~7 steps)


class ChunkCosts:
    """seconds(n, c) = base + per_token * n + per_token_ctx * n * c for a chunk of n tokens after
    c cached ones (tools/shardline_tools/sim/costs.py's prefill form), least squares with every term >= 0 over the
    latest SAMPLES chunks of each size class; None until one is seen. Kept by size so that the
    fit always sees several sizes once it has: chunks of one size alone cannot tell a chunk's
    fixed cost from its tokens' (and chunk sizes settle as the context grows)."""

    def __init__(self) -> None:
        self._by_size: dict[int, deque[tuple[int, int, float]]] = {}
        self._coef: np.ndarray | None = None

    def observe(self, n: int, c: int, seconds: float) -> None:
        if n >= 1 and c >= 0 and seconds > 0:
            self._by_size.setdefault(n.bit_length(), deque(maxlen=SAMPLES)).append((n, c, seconds))
            self._coef = None

    def seconds(self, n: int, c: int) -> float | None:
        coef = self._fit()
        return None if coef is None else float(coef @ (1.0, n, n * c))

    def tokens_within(self, seconds: float, c: int, cap: int) -> int:
        """The most tokens (up to `cap`) whose chunk after `c` fits `seconds`, but never fewer than
        pay for the chunk's fixed cost once over (a chunk of fewer is mostly overhead: on these
        CPUs a step's fixed cost is about a decode step's, so a prompt fed by 1-token chunks
        would crawl), nor fewer than MIN_CHUNK."""
        coef = self._fit()
        if coef is None or len({n for n, _, _ in self._samples()}) < 2:
            # one chunk size seen (or none): its time cannot be split into a fixed part and a
            # per-token part. Fitting the per-token part alone would price the fixed cost into
            # every token and keep chunks at one token for ever (seen: 37-token prompts fed one
            # token a step); so try a chunk twice the size, which also teaches the model.
            return min(cap, max(EXPLORE, 2 * max((n for n, _, _ in self._samples()), default=0)))
        per_token = coef[1] + coef[2] * c
        if per_token <= 0:
            return cap
        n = int((seconds - coef[0]) / per_token + 1e-9)
        floor = max(MIN_CHUNK, int(np.ceil(coef[0] / per_token - 1e-9)))
        return min(cap, max(n, floor))

    def _samples(self) -> list[tuple[int, int, float]]:
        return [sample for size in self._by_size.values() for sample in size]

    def _fit(self) -> np.ndarray | None:
        samples = self._samples()
        if self._coef is None and samples:
            x = np.array([(1.0, n, n * c) for n, c, _ in samples])
            y = np.array([s for _, _, s in samples])
            self._coef = _nonnegative_fit(x, y)
        return self._coef


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares over the subsets of the columns that keep the per-token one (a chunk's cost
    grows with its tokens) and whose solution is >= 0; the best one, the smallest on a tie (a
    few samples of one size fit a per-token cost alone)."""
    best, best_err = np.zeros(x.shape[1]), float("inf")
    others = [i for i in range(x.shape[1]) if i != 1]
    for k in range(len(others) + 1):
        for extra in combinations(others, k):
            cols = sorted((1, *extra))
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            err = float(((x[:, cols] @ sol - y) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = np.zeros(x.shape[1]), err
                best[list(cols)] = sol
    return best


class Pacing:
    def __init__(self, cfg: PacingConfig | None = None, full_chunk: int = 128) -> None:
        self.cfg = cfg or PacingConfig()
        self.full_chunk = full_chunk
        self.costs = ChunkCosts()
        self.step_s: float | None = None  # a decode step's graph seconds (its work): the budget's unit
        # graph seconds spent on chunks and on decode steps since prompts began to prefill beside
        # decoding streams, decayed by FORGET a decode step: the share prefill is taking now
        self.prefill_s = 0.0
        self.decode_s = 0.0

    def decode_step(self, graph_s: float) -> None:
        """A decode step came back, its graph seconds over every stage."""
        if graph_s <= 0:
            return
        self.step_s = _average(self.step_s, graph_s, SMOOTH)
        self.prefill_s *= FORGET
        self.decode_s = self.decode_s * FORGET + graph_s

    def short(self, left: int) -> bool:
        """A prompt with `left` tokens still to prefill is not paced."""
        return left <= self.cfg.short

    def chunk_done(self, n: int, c: int, seconds: float, learn: bool = True, counted: bool = True) -> None:
        """A chunk of n tokens after c cached took `seconds` of graph time; `learn`: a chunk the
        cost model may learn from (not one that also paid for opening its stream); `counted`:
        its time counts in prefill's share (not a short prompt's)."""
        if seconds > 0 and counted:
            self.prefill_s += seconds
        if learn:
            self.costs.observe(n, c, seconds)

    def budget_s(self) -> float:
        return self.cfg.budget * (self.step_s or 0.0)

    def share(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.prefill_s / total if total else 0.0

    def behind(self) -> bool:
        """Prefill has lately taken more than its share of the stages' time."""
        return self.share() > self.cfg.share

    def sizes(self, prompts: list[tuple[int, int]], decoding: bool, prefilling: bool) -> list[int]:
        """Tokens for the next chunk of each prompt ready for one, given as (tokens left, tokens
        cached) in arrival order; 0: not this round. The round's budget goes to the oldest first.
        `prefilling`: some prompt is being prefilled (ready, or a chunk of it in flight)."""
        if not prefilling or not decoding:
            self.prefill_s = self.decode_s = 0.0  # the share counts from when prompts meet streams
            return [min(left, self.full_chunk) for left, _ in prompts]
        out: list[int] = []
        left_s = self.budget_s()
        for left, cached in prompts:
            n = 0 if self.behind() else min(left, self.costs.tokens_within(left_s, cached, self.full_chunk))
            seconds = self.costs.seconds(n, cached) or 0.0
            if out and seconds > left_s:  # the oldest always gets its chunk; later ones what is left
                n = 0
            left_s -= seconds if n else 0.0
            out.append(n)
        return out


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
