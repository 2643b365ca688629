"""Per-stream KV bookkeeping (physical slots, logical positions, the attention mask) and the
inputs every stage runs a step with.

Invariants:
- The in-graph KV cache only grows: `slots` counts its physical entries.
- `position` is the logical index of the next token; it drives RoPE. The two differ once
  speculation masks out rejected drafts (the slots stay, masked, and positions step back).
- The attention mask covers `slots + new tokens`; a slot masked to 0 stays 0 for ever.
- Every stage of a stream receives the same mask and positions for a step.
- A row of a group's step may carry fewer tokens than the others: it is right-padded with
  masked tokens (slot written, mask 0 for ever, position irrelevant), as a rejected draft is.
- Compaction (speculation's cleanup) keeps each row's attended slots in order and left-pads
  the rows to the longest; every stage and the coordinator's books derive it from the mask
  alone (`compaction`), so nothing but a flag crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class StepInputs:
    """What every stage needs for one step: of one stream (B = 1), or of a decode group's B
    streams at once (one row each, every row with the same number T of new tokens)."""

    input_ids: np.ndarray  # [B, T] i64 (used by stage 0 only)
    attention_mask: np.ndarray  # [B, slots + T] i64
    position_ids: np.ndarray  # [B, T] i64
    # Which rows of the KV state each input row continues (the graph's Gather on every KV read):
    # None is the identity. A group drops a row by leaving its index out.
    beam_idx: np.ndarray | None = None
    # Last stage only: which of the T new positions of each row get logits ([B, N] i64, indices
    # into T). The lm_head runs for those alone; None means the last position of every row.
    logits_index: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.attention_mask.shape[0])

    @property
    def new_tokens(self) -> int:
        return int(self.position_ids.shape[1])

    def compacted(self) -> tuple[np.ndarray, StepInputs]:
        """This step after compacting the cache its mask describes: which slots each row of the
        state keeps (see `compaction`) and the same step over the compacted cache."""
        t = self.new_tokens
        index, mask = compaction(self.attention_mask[:, :-t])
        return index, replace(self, attention_mask=np.concatenate([mask, self.attention_mask[:, -t:]], axis=1))

    @staticmethod
    def stack(rows: list[StepInputs], beam_idx: np.ndarray | None = None) -> StepInputs:
        """One step of several streams as one batch (their masks must be equally long)."""
        return StepInputs(np.concatenate([r.input_ids for r in rows]),
                          np.concatenate([r.attention_mask for r in rows]),
                          np.concatenate([r.position_ids for r in rows]), beam_idx)


def logits_index(sample_at: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The graph's `logits_index` for the (row, t) pairs of `sample_at` ([E, 2]), and where each
    pair's logits come out: column `pick[e]` of its row. Rows that want fewer positions than
    the widest repeat their last one (or position 0): one rectangular [B, N] gather."""
    per_row: list[list[int]] = [[] for _ in range(rows)]
    pick = np.zeros(sample_at.shape[0], np.int64)
    for e, (r, t) in enumerate(sample_at.tolist()):
        pick[e] = len(per_row[r])
        per_row[r].append(t)
    n = max((len(p) for p in per_row), default=0)
    index = np.zeros((rows, n), np.int64)
    for r, p in enumerate(per_row):
        if p:
            index[r, : len(p)] = p
            index[r, len(p):] = p[-1]
    return index, pick


def compaction(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For cache rows masked by `mask` [B, S]: the slots each row keeps (`index` [B, W], to
    gather along the slots axis) and its mask afterwards ([B, W]). Each row keeps its attended
    slots in order, right-aligned; the shorter rows are left-padded (gathering slot 0, masked)."""
    live = [np.flatnonzero(row) for row in mask]
    width = max((len(x) for x in live), default=0)
    index = np.zeros((mask.shape[0], width), np.int64)
    after = np.zeros((mask.shape[0], width), np.int64)
    for r, x in enumerate(live):
        index[r, width - len(x):] = x
        after[r, width - len(x):] = 1
    return index, after


class KVBook:
    def __init__(self) -> None:
        self._keep = np.zeros(0, dtype=np.int64)  # one entry per physical slot: 1 attend, 0 masked
        self.position = 0

    @classmethod
    def filled(cls, n: int) -> KVBook:
        """A cache of `n` slots holding positions 0..n-1, every one attended (a prefix's copy)."""
        book = cls()
        book._keep, book.position = np.ones(n, np.int64), n
        return book

    @property
    def slots(self) -> int:
        return int(self._keep.shape[0])

    def attended(self) -> np.ndarray:
        """The slots a step attends, in order: slot `attended()[i]` holds the token at position i
        (rejected drafts and pads are masked; positions count attended slots alone)."""
        return np.flatnonzero(self._keep)

    @property
    def masked(self) -> int:
        """Physical slots no step will attend again (rejected drafts, pads, left padding)."""
        return self.slots - int(self._keep.sum())

    def plan(self, tokens: list[int], pad: int = 0, left: int = 0) -> StepInputs:
        """Inputs for feeding `tokens` next (one row), then `pad` masked tokens (a row of a group
        whose others carry more), over the cache left-padded by `left` masked slots (a row of a
        group state wider than its own); call `commit` once the step is sent."""
        t = len(tokens)
        new = np.concatenate([np.ones(t, np.int64), np.zeros(pad, np.int64)])
        mask = np.concatenate([np.zeros(left, np.int64), self._keep, new])[None, :]
        positions = np.arange(self.position, self.position + t + pad, dtype=np.int64)[None, :]
        ids = tokens + [tokens[-1]] * pad
        return StepInputs(np.asarray([ids], dtype=np.int64), mask, positions)

    def commit(self, inputs: StepInputs, row: int = 0) -> None:
        """The step was sent: its mask row is the cache's from now on (compacted if the step
        compacts); the position advances by the row's attended new tokens, not its pads."""
        self._keep = inputs.attention_mask[row].copy()
        self.position += int(self._keep[-inputs.new_tokens:].sum())

    def pad_left(self, n: int) -> None:
        """`n` masked slots before the stream's own: its KV became a row of a longer batch state
        (left-padded). Positions are logical, so they do not move."""
        if n == 0:  # every decode step of a group calls this: most steps need no copy
            return
        self._keep = np.concatenate([np.zeros(n, dtype=np.int64), self._keep])

    def mask_last(self, n: int) -> None:
        """Forget the last `n` accepted tokens logically: mask their slots, step positions back."""
        if not 0 <= n <= self.position:
            raise ValueError(f"cannot mask {n} tokens of {self.position}")
        live = np.flatnonzero(self._keep)
        if n:
            self._keep[live[-n:]] = 0
        self.position -= n

    def compact(self) -> np.ndarray:
        """Drop the masked slots from the book; the slots the cache keeps ([1, W], for
        StageRunner.compact), when the cache itself is compacted alongside."""
        index, after = compaction(self._keep[None, :])
        self._keep = after[0]
        return index

    def reset(self) -> None:
        self._keep = np.zeros(0, dtype=np.int64)
        self.position = 0
