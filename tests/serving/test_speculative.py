"""Speculative decoding on the real model, in process: greedy output equals plain greedy output
token for token over whole generations, for each draft source, alone and inside decode groups
(rows speculating different amounts), through many compactions; seeded sampling gives the
same tokens as without speculation (certain drafts verify by the plain sampler's own draws)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.config import SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.helpers import engine_tokens, staggered

LONG = 240  # a whole generation (stop tokens are not honoured here)
TEXTS = [
    "Rewrite this more formally: the meeting got moved to friday because the boss was sick, so everyone "
    "has to bring their reports then, and the reports should have the numbers from last month.",
    "Write a Python function that returns the sum of the squares of a list of numbers, with a docstring.",
]


@pytest.fixture(scope="module")
def prompts(two: Path) -> list[list[int]]:
    tok = ChatTokenizer(two)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(pipe: LocalPipeline, prompts: list[list[int]]) -> list[list[int]]:
    return [engine_tokens(pipe, p, SamplingConfig(max_tokens=LONG), groups=0) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("k,groups,compact_at", [(4, 0, 64), (None, 1, 16)], ids=["k4-alone", "auto-group-compact16"])
def test_ngram_greedy_equals_plain_for_whole_generations(pipe: LocalPipeline, prompts: list[list[int]],
                                                         plain: list[list[int]], k: int | None, groups: int,
                                                         compact_at: int) -> None:
    drafts = Drafts(LookupDrafter, k, 8)
    for prompt, want in zip(prompts, plain, strict=True):
        assert engine_tokens(pipe, prompt, SamplingConfig(max_tokens=LONG), drafts=drafts, groups=groups,
                             compact_at=compact_at) == want


def test_ngram_inside_a_decode_group_with_joins_and_leaves(pipe: LocalPipeline, prompts: list[list[int]],
                                                           plain: list[list[int]]) -> None:
    """Three streams join one group while others run and leave at different lengths; each row
    verifies its own number of drafts; compaction every 8 masked slots."""
    engine = Engine(pipe, Limits(4, 4), 8192, SchedulerConfig(groups=1, compact_at=8), Drafts(LookupDrafter, 3, 8))
    try:
        got = staggered(engine, [prompts[0], prompts[1], prompts[0]], [90, 60, 40])
    finally:
        engine.stop()
    assert got == [plain[0][:90], plain[1][:60], plain[0][:40]]


def test_seeded_sampling_gives_the_same_tokens_with_certain_drafts(pipe: LocalPipeline,
                                                                   prompts: list[list[int]]) -> None:
    cfg = SamplingConfig(max_tokens=80, temperature=0.7, top_k=40, seed=5)
    want = engine_tokens(pipe, prompts[0], cfg, groups=0)
    assert engine_tokens(pipe, prompts[0], cfg, drafts=Drafts(LookupDrafter, 4, 8), groups=0) == want
