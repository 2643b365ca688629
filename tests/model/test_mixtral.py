"""Mixtral-style experts in a `llama` GGUF (issue 38, point 1, second part): a file that says
`llama` with `llama.expert_count` reads as the mixtral family, Llama's attention (Q/K rows in
llama.cpp's interleaved order) and a softmax top-2 router over 8 SwiGLU experts whose width is
the file's feed_forward_length. Its greedy tokens and log-probabilities at LOGIT_STEPS equal
llama.cpp's (tests/golden/families.json, llama-server on the f32 copy) at 1 and 3 stages, the
experts run as the plugin's GatherMatmul nodes, and a llama file without experts stays llama."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.model.manifest import load_manifest
from shardline.pipeline.local import LocalPipeline
from shardline.stage.block_ops import read_stage
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import greedy_ours

EXACT = RunConfig(precision="exact", threads=2)
CASE = Case(FileSpec(name="mixtral-Q8_0", arch="llama", weights="Q8_0", layers=3, ffn=128, experts=8,
                     experts_used=2, expert_ffn=128, rope_theta=1e6), prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def folders(mixtral: Path) -> dict[int, Path]:
    return {n: export(ExportConfig(out=mixtral.parent / f"shards-{n}", model=mixtral, stages=n, isolate=False,
                                   progress=False)) for n in (1, 3)}


def test_a_llama_file_with_experts_reads_as_mixtral(mixtral: Path, tmp_path: Path) -> None:
    arch = GGUFSource(mixtral).arch
    assert (arch.family, arch.experts, arch.experts_used, arch.expert_ffn) == ("mixtral", 8, 2, 128)
    assert "model.layers.0.mlp.experts.gate_proj.weight" in arch.layer_tensors(0)
    dense = Case(FileSpec(name="llama-dense", arch="llama", layers=1)).write(tmp_path)
    assert GGUFSource(dense).arch.family == "llama"


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(stages: int, mixtral: Path,
                                                              folders: dict[int, Path]) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(mixtral) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    with LocalPipeline(folders[stages], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    kept = [s for s in LOGIT_STEPS if str(s) in golden["logprobs"]]  # none for a token ending mid-character
    assert len(kept) >= 3
    for step in kept:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_the_plugin_runs_the_experts_as_gather_matmuls(folders: dict[int, Path]) -> None:
    folder = folders[1]
    (stage,) = load_manifest(folder).stages
    core = ov.Core()
    model, _ = read_stage(core, folder / stage.xml, RunConfig())  # block ops in the plugin form
    compiled = core.compile_model(model, "CPU")
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert kinds.count("GatherMatmul") == 3 * CASE.spec.layers
    assert "Tile" not in kinds


def test_experts_of_another_width_than_the_ffn_are_refused(tmp_path: Path) -> None:
    """llama.cpp sizes a llama file's experts by feed_forward_length, whatever else the file says."""
    spec = CASE.spec.with_(name="mixtral-width", layers=1, ffn=96)
    with pytest.raises(ShardlineError, match="tensor blk.0.ffn_gate_exps.weight has shape \\[8, 128, 256\\], "
                                             "expected \\[8, 96, 256\\]"):
        GGUFSource(Case(spec).write(tmp_path))


def test_experts_in_a_family_without_them_are_refused(tmp_path: Path) -> None:
    spec = FileSpec(name="qwen2-experts", arch="qwen2", biases=True, layers=1, extra_keys={"{arch}.expert_count": 8})
    with pytest.raises(ShardlineError, match="qwen2-experts.gguf: mixture-of-experts models \\(8 experts\\) are not "
                                             "supported"):
        GGUFSource(Case(spec).write(tmp_path))
