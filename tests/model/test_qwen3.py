"""Qwen3 (dense) from a hand-built GGUF file (issue 37, point 1): per-head RMSNorm of queries and
keys before rotary positions, no biases, NEOX rotary, and a head size of its own (4 heads of 96
over a hidden size of 256: q is 384 wide, o_proj maps it back). The file, exported as it is
stored (Q8_0 blocks kept), gives transformers' GGUF loader's greedy tokens and logits on the same
file (dequantized to fp32 by gguf-py) at 1 and 3 stages. A file without its q/k norms is refused
by name before anything is written.

The same file's tokens and every log-probability at LOGIT_STEPS equal llama.cpp's
(tests/golden/families.json, made by llama-server on the file's f32 copy:
tests/golden/families_llama_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.pipeline.local import LocalPipeline
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import greedy_ours

EXACT = RunConfig(precision="exact", threads=2)
# An untied head: with a tied one these random weights repeat one token (the tied cases of
# tests/gguf_cases.py do too); varied tokens make the comparison sharper.
CASE = Case(FileSpec(name="qwen3-Q8_0", arch="qwen3", weights="Q8_0", layers=3, head_size=96, qk_norms=True,
                     rope_theta=1e6), prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def reference(qwen3: Path) -> tuple[list[int], np.ndarray]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.model.reference import greedy_reference

    # transformers' GGUF config reader takes no head size from the file (Qwen3Config's default of
    # 128 stays): it is given here, the file's tensors are still read and dequantized by it.
    config = AutoConfig.from_pretrained(qwen3.parent, gguf_file=qwen3.name)
    config.head_dim = CASE.spec.head_dim
    model = AutoModelForCausalLM.from_pretrained(qwen3.parent, gguf_file=qwen3.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    return greedy_reference(model, CASE.prompt(), STEPS)


def test_the_file_reads_as_qwen3_with_its_own_head_size(qwen3: Path) -> None:
    arch = GGUFSource(qwen3).arch
    assert (arch.family, arch.hidden, arch.n_heads, arch.n_kv_heads, arch.head_dim) == ("qwen3", 256, 4, 2, 96)
    assert arch.biases == () and not arch.tied_embeddings
    assert "model.layers.2.self_attn.k_norm.weight" in arch.layer_tensors(2)


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_logits_equal_transformers(stages: int, qwen3: Path, reference: tuple[list[int], np.ndarray],
                                                     tmp_path: Path) -> None:
    folder = export(ExportConfig(out=tmp_path / "shards", model=qwen3, stages=stages, isolate=False, progress=False))
    with LocalPipeline(folder, EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == reference[0]
    np.testing.assert_allclose(logits, reference[1], rtol=0, atol=TOLERANCE)


def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(qwen3: Path, tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(qwen3) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    folder = export(ExportConfig(out=tmp_path / "shards", model=qwen3, stages=2, isolate=False, progress=False))
    with LocalPipeline(folder, EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    for step in LOGIT_STEPS:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())  # log-softmax, as llama-server gives them
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_a_file_without_its_qk_norms_is_refused(tmp_path: Path) -> None:
    path = Case(CASE.spec.with_(name="qwen3-no-norms", qk_norms=False)).write(tmp_path)
    out = tmp_path / "shards"
    with pytest.raises(ShardlineError, match="attn_q_norm"):
        export(ExportConfig(out=out, model=path, stages=1, isolate=False, progress=False))
    assert not out.exists()
