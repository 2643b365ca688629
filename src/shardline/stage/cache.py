"""Per-stream KV bookkeeping: physical slots, logical positions, and the attention mask.

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
class Prefill:
    """Prompt tokens for a fresh (or continuing) stream: many tokens, logits only needed at the end."""

    tokens: list[int]


@dataclass(frozen=True)
class Decode:
    """One generated token fed back in."""

    token: int


Step = Prefill | Decode


@dataclass(frozen=True)
class StepInputs:
    """What every stage needs for one step: of one stream (B = 1), or of a decode group's B
    streams at once (T = 1, one row each; see pipeline/groups.py)."""

    input_ids: np.ndarray  # [B, T] i64 (used by stage 0 only)
    attention_mask: np.ndarray  # [B, slots + T] i64
    position_ids: np.ndarray  # [B, T] i64
    # Which rows of the KV state each input row continues (the graph's Gather on every KV read):
    # None is the identity. A group drops a row by leaving its index out.
    beam_idx: np.ndarray | None = None

    @staticmethod
    def stack(rows: list[StepInputs], beam_idx: np.ndarray | None = None) -> StepInputs:
        """One decode step of several streams as one batch (their masks must be equally long)."""
        return StepInputs(np.concatenate([r.input_ids for r in rows]),
                          np.concatenate([r.attention_mask for r in rows]),
                          np.concatenate([r.position_ids for r in rows]), beam_idx)


class KVBook:
    def __init__(self) -> None:
        self._keep = np.zeros(0, dtype=np.int64)  # one entry per physical slot: 1 attend, 0 masked
        self.position = 0

    @property
    def slots(self) -> int:
        return int(self._keep.shape[0])

    def plan(self, step: Step) -> StepInputs:
        """Inputs for `step`; call `commit` after every stage has run it."""
        tokens = step.tokens if isinstance(step, Prefill) else [step.token]
        t = len(tokens)
        mask = np.concatenate([self._keep, np.ones(t, dtype=np.int64)])[None, :]
        positions = np.arange(self.position, self.position + t, dtype=np.int64)[None, :]
        return StepInputs(np.asarray([tokens], dtype=np.int64), mask, positions)

    def commit(self, inputs: StepInputs) -> None:
        self._keep = inputs.attention_mask[0].copy()
        self.position += inputs.position_ids.shape[1]

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
