"""Decode groups on the real model: streams batched into one call per stage, joining and
leaving at different steps, give exactly the tokens each gives alone (exact precision)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours

LENGTHS = [12, 20, 6, 16, 9]  # tokens per stream: they leave at different steps


def staggered(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Stream i starts once stream i-1 has 3 tokens (so it joins running groups) and ends after
    lengths[i] tokens (so groups lose rows mid-way)."""
    got: list[list[int]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def collect(i: int) -> Callable[[Event], None]:
        def on(ev: Event) -> None:
            if ev.token is not None:
                got[i].append(ev.token)
                if len(got[i]) == 3:
                    started[i].set()
            else:
                assert ev.finish == "length", ev
                started[i].set()
                done[i].set()
        return on

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        if i:
            assert started[i - 1].wait(120)
        engine.submit(Request(p, SamplingConfig(max_tokens=n), frozenset()), collect(i))
    for d in done:
        assert d.wait(120)
    return got


@pytest.mark.parametrize(("groups", "rows"), [(1, 8), (2, 8), (1, 2)], ids=["one", "two", "overflow"])
def test_groups_equal_alone(shards: Callable[..., Path], groups: int, rows: int) -> None:
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]
    with LocalPipeline(folder, RunConfig()) as pipe:
        alone = [greedy_ours(pipe, p, n)[0] for p, n in zip(prompts, LENGTHS, strict=True)]
        engine = Engine(pipe, Limits(8, 8), 8192, SchedulerConfig(groups=groups, max_rows=rows))
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
