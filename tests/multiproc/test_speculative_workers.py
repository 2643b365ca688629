"""Speculative decoding through real worker processes: the workers keep no speculation logic
(they see masks, positions, a compaction flag and, for sampled drafts, q's support), and give
the in-process tokens: greedy speculation equals plain greedy decoding for whole generations,
alone and in decode groups, with prompt lookup and with a draft model; sampled drafts verified
at the last worker give the tokens they give in process (the same seeded draws)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.export.exporter import export
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.draft_model import DraftModel
from tests.helpers import engine_tokens, staggered
from tests.multiproc.procs import Proc, workers_of

LONG = 160
TEXTS = ["Rewrite this more formally: the boss is sick so the meeting moved to friday, bring the reports then.",
         "List five animals that live in the sea, one per line, each with one fact."]


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def first6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(ExportConfig(out=tmp_path_factory.mktemp("self") / "first6", stages=1, weights="gguf", truncate=6,
                               isolate=False, progress=False))


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Proc]]:
    with workers_of(three, "1", "2") as ws:
        yield ws


@pytest.fixture(scope="module")
def remote(three: Path, workers: list[Proc]) -> Iterator[RemotePipeline]:
    pipe = RemotePipeline(three, [w.addr for w in workers], RunConfig(), activations="f32")
    yield pipe
    pipe.shutdown()


@pytest.fixture(scope="module")
def prompts(three: Path) -> list[list[int]]:
    tok = ChatTokenizer(three)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(three: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LocalPipeline(three) as local:
        return [engine_tokens(local, p, SamplingConfig(max_tokens=LONG), groups=0) for p in prompts]


@pytest.mark.slow
def test_lookup_through_workers_equals_plain_alone_and_in_a_group(remote: RemotePipeline, prompts: list[list[int]],
                                                                  plain: list[list[int]]) -> None:
    drafts = Drafts(LookupDrafter, None, 8)
    assert engine_tokens(remote, prompts[0], SamplingConfig(max_tokens=LONG), drafts=drafts, groups=0,
                         compact_at=8) == plain[0]
    engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1, compact_at=8), Drafts(LookupDrafter, 4, 8))
    try:
        got = staggered(engine, [prompts[0], prompts[1]], [LONG, 100])
    finally:
        engine.stop()
    assert got == [plain[0], plain[1][:100]]


@pytest.mark.slow
def test_a_draft_model_through_workers_greedy_and_sampled(three: Path, first6: Path, remote: RemotePipeline,
                                                          prompts: list[list[int]], plain: list[list[int]]) -> None:
    draft = DraftModel(first6, load_manifest(three))
    drafts = Drafts(draft.drafter, 3, 8)
    assert engine_tokens(remote, prompts[1], SamplingConfig(max_tokens=LONG), drafts=drafts, groups=0,
                         compact_at=8) == plain[1]
    engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1, compact_at=8), Drafts(draft.drafter, 2, 8))
    try:
        got = staggered(engine, [prompts[1], prompts[0]], [LONG, 120])
    finally:
        engine.stop()
    assert got == [plain[1], plain[0][:120]]
    sampled = SamplingConfig(max_tokens=40, temperature=0.8, top_k=20, seed=3)
    with LocalPipeline(three) as local:
        want = engine_tokens(local, prompts[1], sampled, drafts=drafts, groups=0)
    assert engine_tokens(remote, prompts[1], sampled, drafts=drafts, groups=0) == want
