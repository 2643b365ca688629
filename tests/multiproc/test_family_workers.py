"""The 2026 families through worker processes (issues 37 and 38): the hand-built Qwen3, Gemma 3,
Qwen3-MoE, Mixtral and gpt-oss files of tests/model/test_{qwen3,gemma3,qwen3moe,mixtral,gptoss}.py (prompts past
Gemma's window) exported in 3 stages, stage 0 here and two `shardline worker`s on loopback. Greedy
tokens equal one stage in process: alone, as rows of a decode group joined while another stream
decodes, and under prompt-lookup speculation (its masked slots and compaction)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.export.exporter import export
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.gguf_cases import Case
from tests.helpers import engine_tokens, staggered
from tests.model import test_gemma3, test_gptoss, test_mixtral, test_qwen3, test_qwen3moe
from tests.multiproc.procs import worker

EXACT = RunConfig(precision="exact")
N = 40
CASES = {"qwen3": test_qwen3.CASE, "gemma3": test_gemma3.CASE, "qwen3moe": test_qwen3moe.CASE,
         "mixtral": test_mixtral.CASE, "gpt-oss": test_gptoss.CASE}
PROMPTS = [[(5 + 11 * i) % 250 + 3 for i in range(23)]]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def folders(case: Case, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp(f"{case.spec.arch}-workers")
    path = case.write(root)
    return {n: export(ExportConfig(out=root / f"shards-{n}", model=path, stages=n, isolate=False, progress=False))
            for n in (1, 3)}


@pytest.fixture(scope="module")
def prompts(case: Case) -> list[list[int]]:
    return [case.prompt(), *PROMPTS]


@pytest.fixture(scope="module")
def plain(folders: dict[int, Path], prompts: list[list[int]]) -> list[list[int]]:
    with LocalPipeline(folders[1], EXACT) as local:
        return [engine_tokens(local, p, SamplingConfig(max_tokens=N), groups=0) for p in prompts]


@pytest.fixture(scope="module")
def remote(folders: dict[int, Path]) -> Iterator[RemotePipeline]:
    ws = [worker(folders[3], "1"), worker(folders[3], "2")]
    try:
        pipe = RemotePipeline(folders[3], [w.addr for w in ws], EXACT, activations="f32")
        yield pipe
        pipe.shutdown()
    finally:
        for w in ws:
            w.stop()


def test_through_two_workers_alone_and_in_a_decode_group(remote: RemotePipeline, prompts: list[list[int]],
                                                          plain: list[list[int]]) -> None:
    assert engine_tokens(remote, prompts[0], SamplingConfig(max_tokens=N), groups=0) == plain[0]
    engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1))
    try:
        assert staggered(engine, prompts, [N, N]) == plain
    finally:
        engine.stop()


def test_through_two_workers_under_speculation(remote: RemotePipeline, prompts: list[list[int]],
                                               plain: list[list[int]]) -> None:
    drafts = Drafts(LookupDrafter, None, 8)
    assert engine_tokens(remote, prompts[1], SamplingConfig(max_tokens=N), drafts=drafts, groups=0,
                         compact_at=8) == plain[1]
