"""Per-stream KV bookkeeping (physical slots, logical positions, the attention mask) and the
inputs every stage runs a step with.

Invariants:
- The in-graph KV cache only grows: `slots` counts its physical entries.
- `position` is the logical index of the next token; it drives RoPE. The two differ once
  speculation masks out rejected drafts (the slots stay, masked, and positions step back).
- The attention mask covers `slots + new tokens`; a slot masked to 0 stays 0 for ever.
- Every stage of a stream receives the same mask and positions for a step.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class KVBook:
    def __init__(self) -> None:
        self._keep = np.zeros(0, dtype=np.int64)  # one entry per physical slot: 1 attend, 0 masked
        self.position = 0

    @property
    def slots(self) -> int:
        return int(self._keep.shape[0])

    def plan(self, tokens: list[int]) -> StepInputs:
        """Inputs for feeding `tokens` next (one row); call `commit` once the step is sent."""
        t = len(tokens)
        mask = np.concatenate([self._keep, np.ones(t, dtype=np.int64)])[None, :]
        positions = np.arange(self.position, self.position + t, dtype=np.int64)[None, :]
        return StepInputs(np.asarray([tokens], dtype=np.int64), mask, positions)

    def commit(self, inputs: StepInputs, row: int = 0) -> None:
        self._keep = inputs.attention_mask[row].copy()
        self.position += inputs.new_tokens

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

    def reset(self) -> None:
        self._keep = np.zeros(0, dtype=np.int64)
        self.position = 0
