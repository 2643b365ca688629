"""The decoding loop: prefill the prompt, then decode one token at a time until a stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from shardline.config import SamplingConfig
from shardline.decoding.sampler import Choice
from shardline.errors import ShardlineError
from shardline.stage.cache import Decode, Prefill, Step


class Pipeline(Protocol):
    """Anything that runs every stage for a stream and samples at the end of the chain."""

    def open(self, sampling: SamplingConfig | None = None) -> int: ...
    def close(self, stream: int) -> None: ...
    def advance(self, stream: int, step: Step) -> Choice: ...


def generate(
    pipe: Pipeline, prompt: list[int], cfg: SamplingConfig, stop_ids: set[int], max_context: int
) -> Iterator[int]:
    """Yield generated token ids (the stop token itself is not yielded)."""
    for choice in generate_choices(pipe, prompt, cfg, stop_ids, max_context):
        yield choice.token


def generate_choices(
    pipe: Pipeline, prompt: list[int], cfg: SamplingConfig, stop_ids: set[int], max_context: int
) -> Iterator[Choice]:
    """As `generate`, with each token's log-probability (and logits row if cfg.logprobs > 0)."""
    if not prompt:
        raise ShardlineError("the prompt is empty")
    if len(prompt) + cfg.max_tokens > max_context:
        raise ShardlineError(
            f"prompt of {len(prompt)} tokens plus {cfg.max_tokens} new tokens exceeds the context of {max_context}"
        )
    stream = pipe.open(cfg)
    try:
        step: Step = Prefill(prompt)
        for _ in range(cfg.max_tokens):
            choice = pipe.advance(stream, step)
            if choice.token in stop_ids:
                return
            yield choice
            step = Decode(choice.token)
    finally:
        pipe.close(stream)
