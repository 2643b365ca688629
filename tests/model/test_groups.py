"""Decode groups on the real model: streams batched into one call per stage, joining and
leaving at different steps, give exactly the tokens each gives alone (exact precision)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours, staggered

LENGTHS = [20, 24, 6, 16, 9]  # tokens per stream: they leave at different steps (the first two still
# run when the third joins, so 2-row groups overflow: fixed chunks, as paced ones may hold the
# third prompt back until the first has ended)


@pytest.mark.parametrize(("groups", "rows"), [(1, 8), (2, 8), (1, 2)], ids=["one", "two", "overflow"])
def test_groups_equal_alone(shards: Callable[..., Path], groups: int, rows: int) -> None:
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]
    with LocalPipeline(folder, RunConfig()) as pipe:
        alone = [greedy_ours(pipe, p, n)[0] for p, n in zip(prompts, LENGTHS, strict=True)]
        engine = Engine(pipe, Limits(8, 8), 8192, SchedulerConfig(groups=groups, max_rows=rows, pacing=None))
        try:
            assert staggered(engine, prompts, LENGTHS) == alone
            sched = engine.scheduler
            assert all(not g.members() for g in sched.groups)
            if rows == 2:  # up to 3 streams run at once here: a full group made the scheduler open another
                assert len(sched.groups) > groups
        finally:
            engine.stop()
        pipe.shutdown()  # every step and release has run on every stage
        assert [stage.keys() for stage in pipe.stages] == [[], []]  # every row's KV freed
