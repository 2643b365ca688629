"""What stage 0 saw of a prompt, summarized where it ran (the length predictor's input).

A prefill instance runs stage 0 over every prompt anyway; a pipeline asked to summarize
(`LocalPipeline(summarize=True)`, `PagedPipeline(summarize=True)`) reduces stage 0's output of
each prefill chunk to a `HiddenChunk` on stage 0's thread (a ragged step's: each prompt chunk
in it, `ragged_chunks`), and the chunk's Outcome carries it back to the engine, which adds the
chunks of a stream into its `PromptHidden`. Nothing of size [T, H] is kept.

Invariant: a chunk's summary is made before its output buffer is reused (the runner's output is
a view valid until the key's next step on that stage), so it is copied, never referenced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardline.errors import ShardlineError


@dataclass(frozen=True, eq=False)  # arrays: identity, not an elementwise ==
class HiddenChunk:
    total: np.ndarray  # [H] f64: the sum over the chunk's positions (a long prompt's sum loses nothing)
    last: np.ndarray  # [H] f32: the chunk's last position
    positions: int

    @classmethod
    def of(cls, out: np.ndarray) -> HiddenChunk:
        """The summary of stage 0's output for one prompt chunk, [1, T, H]."""
        if out.ndim != 3 or out.shape[0] != 1 or out.shape[1] < 1 or out.shape[2] < 1:
            raise ShardlineError(f"stage 0's output of shape {out.shape}; expected [1, T, H]")
        return cls(out[0].sum(axis=0, dtype=np.float64), np.array(out[0, -1], np.float32), int(out.shape[1]))


def ragged_chunks(streams: tuple[int, ...], prompts: tuple[bool, ...], begins: np.ndarray,
                  out: np.ndarray) -> dict[int, HiddenChunk]:
    """Each prompt chunk's summary of a ragged step's stage-0 output `out` [T, H] (the sequences
    end to end, sequence q's tokens at begins[q]:begins[q + 1]), by stream; decode tokens are not
    summarized."""
    if out.ndim != 2 or len(begins) != len(streams) + 1 or int(begins[-1]) != out.shape[0]:
        raise ShardlineError(f"stage 0's output of shape {out.shape} for a batch of {len(streams)} sequences")
    return {s: HiddenChunk.of(out[None, int(begins[q]):int(begins[q + 1])])
            for q, (s, prompt) in enumerate(zip(streams, prompts, strict=True)) if prompt}


class PromptHidden:
    """A prompt's chunks added in order: the mean over its positions, its last position, and
    log(1 + positions), as one f32 vector of 2H + 1 (disagg/features.py names the kind)."""

    def __init__(self, hidden: int) -> None:
        self._sum = np.zeros(hidden, np.float64)
        self._last = np.zeros(hidden, np.float32)
        self.positions = 0

    def add(self, chunk: HiddenChunk) -> None:
        if chunk.total.shape != self._sum.shape or chunk.last.shape != self._last.shape:
            raise ShardlineError(f"a hidden summary of width {chunk.total.shape} added to one of {self._sum.shape}")
        self._sum += chunk.total
        self._last = chunk.last
        self.positions += chunk.positions

    def vector(self, length: int | None = None) -> np.ndarray:
        """`length`: the prompt's positions (None: those summarized). A prompt that started from a
        kept prefix (serving/prefix.py) had only the rest run on stage 0: its mean is the rest's,
        its last position and its length are the whole prompt's."""
        if not self.positions:
            raise ShardlineError("no prompt positions were summarized")
        length = self.positions if length is None else length
        if length < self.positions:
            raise ShardlineError(f"a prompt of {length} positions of which {self.positions} were summarized")
        mean = (self._sum / self.positions).astype(np.float32)
        return np.concatenate([mean, self._last, np.array([np.log1p(length)], np.float32)])
