"""Shared by the real-model tests: greedy decoding through shardline and through a reference."""

from __future__ import annotations

import numpy as np

from shardline.config import SamplingConfig
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
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


def staggered(pipe: LocalPipeline | RemotePipeline, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Stream i starts after 3*i outcomes of the others (so it joins running groups) and ends
    after lengths[i] tokens (so groups lose rows mid-way)."""
    out: dict[int, list[int]] = {}
    live: dict[int, int] = {}  # stream -> prompt index
    waiting = list(range(len(prompts)))

    def start() -> None:
        i = waiting.pop(0)
        stream = pipe.open(SamplingConfig(max_tokens=lengths[i]))
        live[stream], out[i] = i, []
        pipe.submit(stream, Prefill(prompts[i]))

    seen = 0
    start()
    for _ in range(1000):  # bounded: every round returns at least one outcome or fails
        if not live and not waiting:
            break
        got = pipe.outcomes(timeout=120)
        assert got, f"no outcome within 120 s; streams still live: {sorted(live)}"
        for o in got:
            assert o.choice is not None, o.error
            i = live[o.stream]
            out[i].append(o.choice.token)
            if len(out[i]) == lengths[i]:
                pipe.close(o.stream)
                del live[o.stream]
            else:
                pipe.submit(o.stream, Decode(o.choice.token))
            seen += 1
            if waiting and seen % 3 == 0:
                start()
        if waiting and not live:
            start()
    return [out[i] for i in range(len(prompts))]
