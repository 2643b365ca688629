"""Decode groups on the real model: streams batched into one call per stage, joining and
leaving at different steps, give exactly the tokens each gives alone (exact precision)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours, staggered

LENGTHS = [12, 20, 6, 16, 9]  # tokens per stream: they leave at different steps


@pytest.mark.parametrize(("groups", "rows"), [(1, 8), (2, 8), (1, 2)], ids=["one", "two", "overflow"])
def test_groups_equal_alone(shards: Callable[..., Path], groups: int, rows: int) -> None:
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    chat_prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]
    pipe = LocalPipeline(folder, RunConfig(), groups=groups, group_rows=rows)
    alone = [greedy_ours(pipe, p, n)[0] for p, n in zip(chat_prompts, LENGTHS, strict=True)]
    assert staggered(pipe, chat_prompts, LENGTHS) == alone
    assert all(stage._streams == {} for stage in pipe.stages)  # every row's KV freed
    assert all(not g.members() for g in pipe.groups)
    if rows == 2:  # up to 3 streams run at once here: a full group made the pipeline open another
        assert len(pipe.groups) > groups
