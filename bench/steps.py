"""Timed steps through a pipeline, shared by the benchmarks that time decoding by hand."""

from __future__ import annotations

import time
from typing import Any

from shardline.config import SamplingParams
from shardline.pipeline.plan import decode, run
from shardline.stage.cache import KVBook

GREEDY = SamplingParams()


def decode_tok_s(pipe: Any, key: int, book: KVBook, last: int, tokens: int, warmup: int) -> float:
    """Greedy decode tok/s of stream `key` (its prompt already prefilled into `book`, `last` the
    token it sampled) over `tokens` one-token steps, after `warmup` untimed ones."""
    for _ in range(warmup):
        (out,) = run(pipe, decode(key, book, [last], GREEDY))
        last = out.choices[0].token
    start = time.perf_counter()
    for _ in range(tokens):
        (out,) = run(pipe, decode(key, book, [last], GREEDY))
        last = out.choices[0].token
    return tokens / (time.perf_counter() - start)
