"""The decoding loop: prefill the prompt, then decode one token at a time until a stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from shardline.config import SamplingConfig
from shardline.decoding.sampler import Sampler
from shardline.errors import ShardlineError
from shardline.stage.cache import Decode, Prefill, Step


class Pipeline(Protocol):
    def open(self) -> int: ...
    def close(self, stream: int) -> None: ...
    def step(self, stream: int, step: Step) -> np.ndarray: ...


def generate(
    pipe: Pipeline, prompt: list[int], cfg: SamplingConfig, stop_ids: set[int], max_context: int
) -> Iterator[int]:
    """Yield generated token ids (the stop token itself is not yielded)."""
    if not prompt:
        raise ShardlineError("the prompt is empty")
    if len(prompt) + cfg.max_tokens > max_context:
        raise ShardlineError(
            f"prompt of {len(prompt)} tokens plus {cfg.max_tokens} new tokens exceeds the context of {max_context}"
        )
    sample = Sampler(cfg)
    stream = pipe.open()
    try:
        step: Step = Prefill(prompt)
        for _ in range(cfg.max_tokens):
            token = sample(pipe.step(stream, step)[-1])
            if token in stop_ids:
                return
            yield token
            step = Decode(token)
    finally:
        pipe.close(stream)
