"""Shared by the real-model tests: greedy decoding through shardline and through a reference."""

from __future__ import annotations

import numpy as np

from shardline.pipeline.local import LocalPipeline
from shardline.stage.cache import Decode, Prefill, Step


def greedy_ours(pipe: LocalPipeline, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens (stop tokens ignored) and the logits row that chose each one."""
    stream = pipe.open()
    tokens, rows = [], []
    step: Step = Prefill(prompt)
    try:
        for _ in range(n):
            row = pipe.step(stream, step)[-1].copy()
            tokens.append(int(np.argmax(row)))
            rows.append(row)
            step = Decode(tokens[-1])
    finally:
        pipe.close(stream)
    return tokens, np.stack(rows)
