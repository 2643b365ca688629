"""Qwen3-MoE from a hand-built GGUF file (issue 38, point 1, first part): Qwen3's attention, then
8 experts of 128 rows, 2 chosen per token by a softmax router whose chosen probabilities are
renormalised. Exported as stored (the experts' blocks kept inside the plugin's fused expert
matmuls), its greedy tokens and every log-probability at LOGIT_STEPS equal llama.cpp's
(tests/golden/families.json, llama-server on the f32 copy) at 1 and 3 stages, and the CPU plugin
runs the experts as its GatherMatmul nodes (only the chosen experts computed). Decode groups and
speculation (rows and positions choosing different experts) give the plain tokens; so do two
workers (tests/multiproc/test_family_workers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.export.inspect import inspect
from shardline.model.gguf_source import GGUFSource
from shardline.model.manifest import load_manifest
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.block_ops import read_stage
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import engine_tokens, greedy_ours, staggered

EXACT = RunConfig(precision="exact", threads=2)
CASE = Case(FileSpec(name="qwen3moe-Q8_0", arch="qwen3moe", weights="Q8_0", layers=3, head_size=64, qk_norms=True,
                     rope_theta=1e6, ffn=256, experts=8, experts_used=2, expert_ffn=128), prompt_len=40)
# Experts 0-6 share one router row: where expert 7 leads, the second is a seven-way tie.
TIES = Case(CASE.spec.with_(name="qwen3moe-ties", layers=2, router_ties=(0, 1, 2, 3, 4, 5, 6)), prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("qwen3moe"))


@pytest.fixture(scope="module")
def folders(qwen3moe: Path) -> dict[int, Path]:
    return {n: export(ExportConfig(out=qwen3moe.parent / f"shards-{n}", model=qwen3moe, stages=n, isolate=False,
                                   progress=False)) for n in (1, 3)}


def test_the_file_reads_as_a_mixture_of_experts(qwen3moe: Path) -> None:
    arch = GGUFSource(qwen3moe).arch
    assert (arch.family, arch.experts, arch.experts_used, arch.expert_ffn) == ("qwen3moe", 8, 2, 128)
    assert "model.layers.1.mlp.experts.down_proj.weight" in arch.layer_tensors(1)
    assert "model.layers.1.mlp.down_proj.weight" not in arch.layer_tensors(1)


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(stages: int, qwen3moe: Path,
                                                              folders: dict[int, Path]) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(qwen3moe) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    with LocalPipeline(folders[stages], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    kept = [s for s in LOGIT_STEPS if str(s) in golden["logprobs"]]  # none for a token ending mid-character
    assert len(kept) >= 3
    for step in kept:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_a_router_tie_breaks_as_llama_cpps(tmp_path: Path) -> None:
    """Tied experts go lower index first, as llama.cpp's argsort orders them. The plugin's TopK
    without `stable` picks expert 1 over 0 in a seven-way tie: its first token already differs."""
    path = TIES.write(tmp_path)
    golden = json.loads(GOLDEN.read_text())["files"][TIES.name]
    assert file_sha256(path) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    folder = export(ExportConfig(out=tmp_path / "shards", model=path, stages=1, isolate=False, progress=False))
    with LocalPipeline(folder, EXACT) as pipe:
        assert greedy_ours(pipe, TIES.prompt(), STEPS)[0] == golden["tokens"]


def test_decode_groups_and_speculation_give_the_plain_tokens(folders: dict[int, Path]) -> None:
    """Rows of a group and a verify step's positions choose different experts in one call."""
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


def test_the_plugin_runs_the_experts_as_gather_matmuls(folders: dict[int, Path]) -> None:
    """Three GatherMatmul nodes per layer and no Tile left: only the chosen experts are computed."""
    folder = folders[1]
    (stage,) = load_manifest(folder).stages
    core = ov.Core()
    model, _ = read_stage(core, folder / stage.xml, RunConfig())  # block ops in the plugin form
    compiled = core.compile_model(model, "CPU")
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert kinds.count("GatherMatmul") == 3 * CASE.spec.layers
    assert "Tile" not in kinds


MIXES = {
    # Q4_1: 4-bit codes with a min, Q4_K: super-blocks, Q5_0: 5-bit codes kept as 8-bit.
    "legacy-and-k": {"*": "Q8_0", "ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q5_0"},
    # llama.cpp's MXFP4_MOE: the experts MXFP4 (kept as int8 codes times the e8m0 scale), the rest Q8_0.
    "mxfp4-moe": {"*": "Q8_0", "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"},
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_experts_stay_in_the_files_blocks_and_equal_their_f32_values(mix: str, tmp_path: Path) -> None:
    """Experts of each block kind stay compressed inside the plugin's GatherMatmul nodes, and give
    the tokens and logits (1e-4) of the same file exported as f32."""
    path = Case(CASE.spec.with_(name=f"qwen3moe-{mix}", weights="F32", mix=MIXES[mix], layers=2)).write(tmp_path)
    kept = export(ExportConfig(out=tmp_path / "gguf", model=path, stages=1, isolate=False, progress=False))
    wide = export(ExportConfig(out=tmp_path / "fp32", model=path, stages=1, weights="fp32", isolate=False,
                               progress=False))
    (stage,) = load_manifest(kept).stages
    experts = {MIXES[mix][k] for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    assert {k: n for k, n in stage.weights_kept.items() if k in experts} == {k: 6 // len(experts) for k in experts}
    if "MXFP4" in experts:
        assert "MXFP4 x6 (as int8 codes times its e8m0 scales: exact, twice its bytes" in inspect(kept)
    core = ov.Core()
    model, _ = read_stage(core, kept / stage.xml, RunConfig())  # block ops in the plugin form
    compiled = core.compile_model(model, "CPU")
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert kinds.count("GatherMatmul") == 3 * 2 and "Tile" not in kinds
    weights = {op.input(1).get_element_type() for op in compiled.get_runtime_model().get_ops()
               if op.get_rt_info()["layerType"].astype(str) == "GatherMatmul"}
    assert ov.Type.f32 not in weights and weights <= {ov.Type.u4, ov.Type.u8, ov.Type.i8}  # still compressed
    with LocalPipeline(kept, EXACT) as a, LocalPipeline(wide, EXACT) as b:
        ours, theirs = greedy_ours(a, CASE.prompt(), 16), greedy_ours(b, CASE.prompt(), 16)
    assert ours[0] == theirs[0]
    np.testing.assert_allclose(ours[1], theirs[1], rtol=0, atol=TOLERANCE)


def test_more_experts_used_than_there_are_is_refused(tmp_path: Path) -> None:
    spec = CASE.spec.with_(name="qwen3moe-bad", layers=1, extra_keys={"{arch}.expert_used_count": 9})
    with pytest.raises(ShardlineError, match="expert_used_count 9 must be in 1-qwen3moe.expert_count \\(8\\)"):
        GGUFSource(Case(spec).write(tmp_path))


def test_expert_tensors_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    spec = CASE.spec.with_(name="qwen3moe-shape", layers=1, extra_keys={"{arch}.expert_feed_forward_length": 64})
    with pytest.raises(ShardlineError, match="tensor blk.0.ffn_gate_exps.weight has shape \\[8, 128, 256\\], "
                                             "expected \\[8, 64, 256\\]"):
        GGUFSource(Case(spec).write(tmp_path))


def test_balance_with_memory_fits_each_stage_then_evens_the_work(qwen3moe: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command line: a node with room for one layer gets one; the others share the
    rest; and memory that cannot hold the model is refused before anything is written."""
    from shardline.cli import main
    from shardline.export.exporter import stage_costs
    from shardline.export.plan import balanced_split

    source = GGUFSource(qwen3moe)
    costs = stage_costs(source.arch, qwen3moe.stat().st_size / source.arch.weights * 1.34)
    one = (costs.first_size + 1.5 * costs.layer_size) / (1 << 30)  # the embedding and one layer, not two
    roomy = 1.0
    out = tmp_path / "fitted"
    assert main(["export", "--model", str(qwen3moe), "--stages", "2", "--balance", "--memory", f"{one},{roomy}",
                 "--out", str(out), "--no-isolate"]) == 0
    assert [(s.first_layer, s.last_layer) for s in load_manifest(out).stages] == [(0, 0), (1, 2)]
    assert [(p.first, p.last) for p in balanced_split(3, 2, source.arch.head_layers)] == [(0, 1), (2, 2)]  # by work
    with LocalPipeline(out, EXACT) as pipe:
        assert greedy_ours(pipe, CASE.prompt(), 8)[0] == json.loads(GOLDEN.read_text())["files"][CASE.name][
            "tokens"][:8]
    assert main(["export", "--model", str(qwen3moe), "--stages", "2", "--balance", "--memory", "0.0001",
                 "--out", str(tmp_path / "none")]) == 1
    assert "stage 0's memory (0.0 GiB) cannot hold even one layer" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
