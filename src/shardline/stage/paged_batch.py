"""One call of a paged stage (issue 41), pure: the new tokens of several sequences end to end,
each with its past length and block table, checked against a pool before OpenVINO sees it.

PagedAttention trusts its inputs: a block table one block short for its tokens writes past the
pool and kills the process (tests/model/test_paged.py found it). So every batch is checked here,
whoever made it (the coordinator's plan, a worker's frame), and a bad one raises StepRefused
before any stage runs: the pool is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardline.errors import StepRefused


@dataclass(frozen=True)
class PagedBatch:
    positions: np.ndarray  # [T] i64: each new token's position in its sequence
    past_lens: np.ndarray  # [S] i32: tokens each sequence already holds in its blocks
    begins: np.ndarray  # [S + 1] i32: where each sequence's new tokens start in the batch
    block_indices: np.ndarray  # [sum of tables] i32: the tables end to end
    block_begins: np.ndarray  # [S + 1] i32: where each sequence's table starts
    logits_at: np.ndarray  # [N] i64: positions of the batch whose logits are wanted (last stage)

    @staticmethod
    def of(seqs: Sequence[tuple[int, int, Sequence[int]]], logits_at: Sequence[int] = ()) -> PagedBatch:
        """From (new tokens, past length, block table) per sequence; positions follow the past."""
        positions = [np.arange(p, p + n, dtype=np.int64) for n, p, _ in seqs]
        tables = [np.asarray(t, np.int32) for _, _, t in seqs]
        return PagedBatch(
            np.concatenate(positions) if seqs else np.zeros(0, np.int64), np.array([p for _, p, _ in seqs], np.int32),
            np.cumsum([0] + [n for n, _, _ in seqs]).astype(np.int32),
            np.concatenate(tables) if seqs else np.zeros(0, np.int32),
            np.cumsum([0] + [len(t) for _, _, t in seqs]).astype(np.int32), np.asarray(logits_at, np.int64))

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def sequences(self) -> int:
        return int(self.past_lens.shape[0])

    def table(self, s: int) -> np.ndarray:
        return self.block_indices[self.block_begins[s] : self.block_begins[s + 1]]

    def written(self, s: int, block_size: int) -> np.ndarray:
        """The blocks sequence s writes: those its new tokens' KV lands in."""
        past, new = int(self.past_lens[s]), int(self.begins[s + 1] - self.begins[s])
        return self.table(s)[past // block_size : -(-(past + new) // block_size)]

    def max_context(self) -> int:
        return int((self.past_lens + np.diff(self.begins)).max()) if self.sequences else 0

    def feed(self) -> dict[str, np.ndarray]:
        """The paged graph's inputs (export/paged.py) but the tokens or hidden states."""
        return {"position_ids": self.positions, "past_lens": self.past_lens, "subsequence_begins": self.begins,
                "block_indices": self.block_indices, "block_indices_begins": self.block_begins,
                "max_context_len": np.array(self.max_context(), np.int32)}

    def check(self, pool: int, block_size: int, context: int | None = None) -> None:
        """StepRefused unless the batch fits a pool of `pool` blocks of `block_size` tokens."""
        _shapes(self)
        s, t = self.sequences, self.tokens
        if s < 1 or t < 1:
            raise StepRefused(f"a paged batch of {s} sequences and {t} tokens")
        if int(self.begins[0]) != 0 or int(self.begins[-1]) != t or (np.diff(self.begins) < 1).any():
            raise StepRefused(f"sequence starts {self.begins.tolist()[:8]} for {t} tokens "
                              "(each sequence takes at least one)")
        ends = self.block_begins
        if int(ends[0]) != 0 or int(ends[-1]) != self.block_indices.shape[0] or (np.diff(ends) < 0).any():
            raise StepRefused(f"block table starts {ends.tolist()[:8]} for {self.block_indices.shape[0]} blocks")
        if self.block_indices.size and (int(self.block_indices.min()) < 0 or int(self.block_indices.max()) >= pool):
            raise StepRefused(f"a block table points outside the pool of {pool} blocks")
        if (self.past_lens < 0).any():
            raise StepRefused("a negative past length")
        if self.logits_at.size and (int(self.logits_at.min()) < 0 or int(self.logits_at.max()) >= t):
            raise StepRefused(f"logits asked at positions outside the batch of {t} tokens")
        for q in range(s):
            _check_sequence(self, q, block_size, context)
        _check_writes(self, block_size)


def _shapes(b: PagedBatch) -> None:
    want = {"positions": (b.positions, np.int64, 1), "past_lens": (b.past_lens, np.int32, 1),
            "begins": (b.begins, np.int32, 1), "block_indices": (b.block_indices, np.int32, 1),
            "block_begins": (b.block_begins, np.int32, 1), "logits_at": (b.logits_at, np.int64, 1)}
    for name, (a, dtype, ndim) in want.items():
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim:
            raise StepRefused(f"paged batch {name}: {getattr(a, 'dtype', type(a))} of {getattr(a, 'shape', '?')}, "
                              f"not {np.dtype(dtype)} of {ndim} axis")
    if b.begins.shape[0] != b.past_lens.shape[0] + 1 or b.block_begins.shape[0] != b.past_lens.shape[0] + 1:
        raise StepRefused("paged batch: starts and tables must number one more than the sequences")


def _check_sequence(b: PagedBatch, q: int, block_size: int, context: int | None) -> None:
    past, start, end = int(b.past_lens[q]), int(b.begins[q]), int(b.begins[q + 1])
    need = -(-(past + end - start) // block_size)
    if b.table(q).shape[0] < need:
        raise StepRefused(f"sequence {q}: {past + end - start} tokens need {need} blocks, its table has "
                          f"{b.table(q).shape[0]}")
    if not np.array_equal(b.positions[start:end], np.arange(past, past + end - start)):
        raise StepRefused(f"sequence {q}: positions do not follow its past of {past}")
    if context is not None and past + end - start > context:
        raise StepRefused(f"sequence {q}: {past + end - start} tokens, past the context of {context}")


def _check_writes(b: PagedBatch, block_size: int) -> None:
    """A block one sequence writes is in no other sequence's table (sharing is of full blocks only)."""
    writer: dict[int, int] = {}
    for q in range(b.sequences):
        for block in b.written(q, block_size).tolist():
            if writer.setdefault(block, q) != q:
                raise StepRefused(f"block {block} is written by sequences {writer[block]} and {q}")
    for q in range(b.sequences):
        for block in set(b.table(q).tolist()) & writer.keys():
            if writer[block] != q:
                raise StepRefused(f"sequence {q} reads block {block}, which sequence {writer[block]} writes")
