"""A static stage (export/static.py: an NPU's fixed shapes) behind the paged runner's interface
(issue 56), so that it runs in a paged pipeline beside paged stages: its KV lives in a pool of
host blocks of the paged stages' block size, and a ragged batch runs sequence by sequence, each
on a ring gathered from its own blocks (StaticRunner under a scratch key: its prefill graph for a
chunk, its decode graph token by token), the new tokens' KV written back into its blocks.

One sequence per graph call is what a static graph of batch 1 can do; the scheduler still fuses
every stream's tokens into one step for the paged stages. A sequence never outgrows the ring:
the pipeline's context is the export's, which a static export caps at its ring.

The pool is numpy zeros, committed page by page as blocks are written (as a paged stage's);
blocks are [blocks, kv_heads, block, head_dim] f32 per KV variable, so a stream's KV moves by
its blocks exactly as it moves out of (and into) a paged stage.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.model.manifest import StageEntry
from shardline.stage.cache import StepInputs
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.static_runner import StaticRunner

_SCRATCH = "blocks"  # the one key the static runner holds, for the sequence being run


class StaticBlocks:
    def __init__(self, folder: Path, entry: StageEntry, run: RunConfig, block_size: int, blocks: int,
                 core: ov.Core | None = None, vocab: int | None = None, context: int | None = None) -> None:
        self.static = StaticRunner(folder, entry, run, core, vocab, context)
        if self.static.sinks is not None:
            raise ShardlineError(f"{entry.name} of {folder}: a static stage with attention sinks slides past its "
                                 "ring, which blocks do not hold; export it without --sinks to run it paged")
        self.entry, self.block_size, self.vocab = entry, block_size, vocab
        self.hidden, self.context, self.has_head = self.static.hidden, self.static.context, entry.has_head
        self._layout = self.static.kv_layout()
        self.allocate(blocks)

    def allocate(self, blocks: int) -> None:
        if blocks < 1:
            raise ShardlineError(f"a static stage's block pool needs at least 1 block, not {blocks}")
        self.pools = {n: np.zeros((blocks, heads, self.block_size, dim), dtype)
                      for n, (dtype, heads, dim) in self._layout.items()}
        self.blocks = blocks

    def block_bytes(self) -> int:
        return sum(heads * self.block_size * dim * dtype.itemsize for dtype, heads, dim in self._layout.values())

    def pool_bytes(self) -> int:
        return self.blocks * self.block_bytes()

    def kv_layout(self) -> dict[str, tuple[np.dtype, int, int]]:
        return self._layout

    def run(self, batch: PagedBatch, x: np.ndarray) -> np.ndarray:
        """As PagedRunner.run: the batch's hidden states [T, H], or the logits [N, V] at
        `batch.logits_at`; StepRefused, every block untouched, for a batch that does not fit."""
        batch.check(self.blocks, self.block_size, self.context)
        if x.shape[0] != batch.tokens:
            raise StepRefused(f"{x.shape[0]} inputs for a batch of {batch.tokens} tokens")
        outs = []
        for q in range(batch.sequences):
            a, b = int(batch.begins[q]), int(batch.begins[q + 1])
            at = batch.logits_at[(batch.logits_at >= a) & (batch.logits_at < b)] - a
            outs.append(self._sequence(batch, q, x[a:b], at))
        return np.concatenate(outs)

    def _sequence(self, batch: PagedBatch, q: int, x: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Sequence q's new tokens over its past, gathered from its blocks into the ring."""
        past, t, table = int(batch.past_lens[q]), x.shape[0], batch.table(q)
        positions = batch.positions[None, int(batch.begins[q]):int(batch.begins[q + 1])]
        inputs = StepInputs(x[None] if self.hidden is None else np.zeros((1, t), np.int64),
                            np.ones((1, past + t), np.int64), positions,
                            logits_index=at[None] if self.has_head else None)
        self.static.open(_SCRATCH)
        try:
            if past:
                self.static.set_kv(_SCRATCH, self.read(tuple(table[: -(-past // self.block_size)].tolist()), past))
            out = self.static.run(_SCRATCH, inputs, None if self.hidden is None else x[None])
            self._scatter(table, past, self.static.kv(_SCRATCH, past))
        finally:
            self.static.close(_SCRATCH)
        return out[0]

    def _scatter(self, table: np.ndarray, past: int, new: dict[str, np.ndarray]) -> None:
        """The new tokens' KV ([1, heads, t, dim] per variable) into slots past.. of `table`."""
        slots = past + np.arange(next(iter(new.values())).shape[2])
        blocks, offsets = table[slots // self.block_size], slots % self.block_size
        for n, a in new.items():
            self.pools[n][blocks, :, offsets] = a[0].transpose(1, 0, 2)

    def read(self, blocks: tuple[int, ...], tokens: int) -> dict[str, np.ndarray]:
        """The KV of the first `tokens` tokens of `blocks`, as one row: [1, heads, tokens, dim] (a copy)."""
        self._movable(blocks, tokens)
        return {n: np.ascontiguousarray(p[list(blocks)].transpose(1, 0, 2, 3).reshape(p.shape[1], -1, p.shape[3])
                                        [None, :, :tokens]) for n, p in self.pools.items()}

    def write(self, blocks: tuple[int, ...], arrays: dict[str, np.ndarray]) -> None:
        """`arrays` ([1, heads, tokens, dim] per variable, as `read` gives them) into `blocks`."""
        tokens = next(iter(arrays.values())).shape[2] if arrays else 0
        self._movable(blocks, tokens)
        if set(arrays) != set(self.pools):
            raise ShardlineError(f"KV of {sorted(arrays)[:4]} for a stage holding {sorted(self.pools)[:4]}")
        self._scatter(np.asarray(blocks), 0, arrays)

    def _movable(self, blocks: tuple[int, ...], tokens: int) -> None:
        if not blocks or min(blocks) < 0 or max(blocks) >= self.blocks or len(set(blocks)) != len(blocks):
            raise ShardlineError(f"KV blocks {list(blocks)[:8]} are not distinct blocks of a pool of {self.blocks}")
        if len(blocks) != -(-tokens // self.block_size) or tokens < 1:
            raise ShardlineError(f"{tokens} tokens do not take {len(blocks)} blocks of {self.block_size}")
