"""gpt-oss from a hand-built GGUF file (issue 38, point 4): biased attention with a learned sink
per head, every other layer local over a 16-token window (the prompt is longer), YaRN rotary,
then 8 experts of 128 rows (down in MXFP4), 2 chosen per token by a biased router whose chosen logits
are softmaxed, each with biases and a clamped SwiGLU. Exported as stored (MXFP4 kept as int8
codes times its e8m0 scale), its greedy tokens and log-probabilities at LOGIT_STEPS equal
llama.cpp's (tests/golden/families.json, llama-server on the f32 copy) at 1 and 3 stages; decode
groups and speculation give the plain tokens. Built paged (issue 56: the sinks as PagedAttention's
own input, the windows as its sliding window), it gives llama.cpp's tokens too, with two streams
fused in each step and prompt-lookup drafts verified in them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.model.manifest import load_manifest
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.paged_local import PagedPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.block_ops import read_stage
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import engine_tokens, greedy_ours, staggered

EXACT = RunConfig(precision="exact", threads=2)
WINDOW = 16
KEYS = {"{arch}.attention.sliding_window": WINDOW, "{arch}.rope.scaling.type": "yarn",
        "{arch}.rope.scaling.factor": 4.0, "{arch}.rope.scaling.original_context_length": 64}
# The down experts in MXFP4 (all three in MXFP4 make this random file repeat one token, in
# llama.cpp as here; tests/model/test_qwen3moe.py keeps all three MXFP4 against their f32 export).
MXFP4 = {"*": "Q8_0", "ffn_down_exps": "MXFP4"}
CASE = Case(FileSpec(name="gptoss-MXFP4", arch="gpt-oss", mix=MXFP4, layers=4, head_size=64, biases=True, oai=True,
                     rope_theta=150000.0, ffn=128, experts=8, experts_used=2, expert_ffn=128, extra_keys=KEYS),
            prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("gptoss"))


@pytest.fixture(scope="module")
def folders(gptoss: Path) -> dict[int, Path]:
    return {n: export(ExportConfig(out=gptoss.parent / f"shards-{n}", model=gptoss, stages=n, isolate=False,
                                   progress=False)) for n in (1, 3)}


def test_the_file_reads_as_gpt_oss(gptoss: Path) -> None:
    arch = GGUFSource(gptoss).arch
    assert (arch.family, arch.experts, arch.experts_used, arch.expert_ffn) == ("gpt-oss", 8, 2, 128)
    assert (arch.sliding_window, arch.local_layers, arch.local_rope_theta) == (WINDOW, (0, 2), None)
    assert arch.biases == ("q_proj", "k_proj", "v_proj", "o_proj") and arch.rope_yarn is not None
    assert "model.layers.1.self_attn.sinks.weight" in arch.layer_tensors(1)


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(stages: int, gptoss: Path,
                                                              folders: dict[int, Path]) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(gptoss) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    with LocalPipeline(folders[stages], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    kept = [s for s in LOGIT_STEPS if str(s) in golden["logprobs"]]  # none for a token ending mid-character
    assert len(kept) >= 3
    for step in kept:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_the_plugin_runs_the_experts_as_gather_matmuls_with_their_biases(folders: dict[int, Path]) -> None:
    """Two GatherMatmul nodes per layer (gate-up, down), weights still compressed, no Tile left:
    only the chosen experts are computed."""
    folder = folders[1]
    (stage,) = load_manifest(folder).stages
    core = ov.Core()
    model, _ = read_stage(core, folder / stage.xml, RunConfig())  # block ops in the plugin form
    compiled = core.compile_model(model, "CPU")
    ops = compiled.get_runtime_model().get_ops()
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in ops]
    assert kinds.count("GatherMatmul") == 2 * CASE.spec.layers and "Tile" not in kinds
    weights = {op.input(1).get_element_type() for op, kind in zip(ops, kinds, strict=True) if kind == "GatherMatmul"}
    assert weights == {ov.Type.i8}  # Q8_0 gate-up and MXFP4 down, kept as int8 codes


def test_decode_groups_and_speculation_give_the_plain_tokens(folders: dict[int, Path]) -> None:
    other = [(7 + 13 * i) % 500 + 3 for i in range(29)]
    with LocalPipeline(folders[3], EXACT) as pipe:
        plain = [greedy_ours(pipe, p, STEPS)[0] for p in (CASE.prompt(), other)]
        engine = Engine(pipe, Limits(4, 4), 4096, SchedulerConfig(chunk=9, groups=1))
        try:
            assert staggered(engine, [CASE.prompt(), other], [STEPS, STEPS]) == plain
        finally:
            engine.stop()
        drafts = Drafts(LookupDrafter, None, 8)
        for prompt, tokens in zip((CASE.prompt(), other), plain, strict=True):
            assert engine_tokens(pipe, prompt, SamplingConfig(max_tokens=STEPS), drafts=drafts, groups=0,
                                 compact_at=8) == tokens


@pytest.mark.parametrize("stages", [1, 3])
def test_paged_it_gives_llama_cpps_tokens_with_streams_fused(stages: int, gptoss: Path,
                                                             folders: dict[int, Path]) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    other = [(7 + 13 * i) % 500 + 3 for i in range(29)]
    with LocalPipeline(folders[3], EXACT) as pipe:
        plain_other = greedy_ours(pipe, other, STEPS)[0]
    folder = export(ExportConfig(out=gptoss.parent / f"paged-{stages}", model=gptoss, stages=stages, paged=True,
                                 isolate=False, progress=False))
    pipe = PagedPipeline(folder, EXACT, 64 << 20)
    pool = BlockPool(pipe.blocks, pipe.block_size)
    drafts = Drafts(LookupDrafter, None, 4) if stages == 3 else None
    engine = Engine(pipe, Limits(4, 4), pipe.context, drafts=drafts,
                    scheduler=PagedScheduler(SchedulerConfig(chunk=9), pool))
    try:
        assert staggered(engine, [CASE.prompt(), other], [STEPS, STEPS]) == [golden["tokens"], plain_other]
        assert pool.held == 0
    finally:
        engine.shutdown()


def test_without_its_sinks_or_statically_it_is_refused(gptoss: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardlineError, match="attention sinks are not built for static stages"):
        export(ExportConfig(out=tmp_path / "static", model=gptoss, stages=1, static=frozenset({0}), isolate=False,
                            progress=False))
    assert not (tmp_path / "static").exists()
