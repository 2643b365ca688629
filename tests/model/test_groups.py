"""Decode groups on the real model: streams batched into one call per stage, joining and
leaving at different steps, give exactly the tokens each gives alone (exact precision)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.stage.cache import Decode, Prefill
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours

LENGTHS = [12, 20, 6, 16, 9]  # tokens per stream: they leave at different steps


def _staggered(pipe: LocalPipeline, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
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


@pytest.mark.parametrize(("groups", "rows"), [(1, 8), (2, 8), (1, 2)], ids=["one", "two", "overflow"])
def test_groups_equal_alone(shards: Callable[..., Path], groups: int, rows: int) -> None:
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    chat_prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]
    pipe = LocalPipeline(folder, RunConfig(), groups=groups, group_rows=rows)
    alone = [greedy_ours(pipe, p, n)[0] for p, n in zip(chat_prompts, LENGTHS, strict=True)]
    assert _staggered(pipe, chat_prompts, LENGTHS) == alone
    assert all(stage._streams == {} for stage in pipe.stages)  # every row's KV freed
    assert all(not g.members() for g in pipe.groups)
    if rows == 2:  # up to 3 streams run at once here: a full group made the pipeline open another
        assert len(pipe.groups) > groups
