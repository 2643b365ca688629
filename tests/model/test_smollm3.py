"""SmolLM3 from a hand-built GGUF file (issue 37, point 5): the Llama layer with every fourth
layer unrotated (NoPE). Exported as stored (Q8_0 blocks kept), its greedy tokens and logits equal
transformers' SmolLM3 on the file's dequantized tensors at 1 and 3 stages, and llama.cpp's
(tests/golden/families.json, llama-server on the f32 copy: exact here, its SiLU is not
approximated)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.pipeline.local import LocalPipeline
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import greedy_ours

EXACT = RunConfig(precision="exact", threads=2)
CASE = Case(FileSpec(name="smollm3-Q8_0", arch="smollm3", weights="Q8_0", layers=5, rope_theta=5e6), prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("smollm3"))


@pytest.fixture(scope="module")
def folders(smollm3: Path) -> dict[int, Path]:
    return {n: export(ExportConfig(out=smollm3.parent / f"shards-{n}", model=smollm3, stages=n, isolate=False,
                                   progress=False)) for n in (1, 3)}


def test_every_fourth_layer_is_unrotated(smollm3: Path) -> None:
    arch = GGUFSource(smollm3).arch
    assert (arch.family, arch.unrotated_layers, arch.local_layers) == ("smollm3", (3,), ())


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_logits_equal_transformers(stages: int, smollm3: Path, folders: dict[int, Path]) -> None:
    from tests.model.reference import greedy_reference, reference_model

    model = reference_model(GGUFSource(smollm3))
    assert model.config.no_rope_layers == [1, 1, 1, 0, 1]  # transformers' own NoPE layout
    tokens_ref, logits_ref = greedy_reference(model, CASE.prompt(), STEPS)
    with LocalPipeline(folders[stages], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == tokens_ref
    np.testing.assert_allclose(logits, logits_ref, rtol=0, atol=TOLERANCE)


def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(smollm3: Path, folders: dict[int, Path]) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(smollm3) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    with LocalPipeline(folders[3], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    for step in LOGIT_STEPS:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)
