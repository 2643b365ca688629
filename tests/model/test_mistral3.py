"""Mistral 3 (Ministral 3, text) from a hand-built GGUF file (issue 37, point 5): the Llama layer
with YaRN rotary scaling (factor 16, no log multiplier: cos and sin scaled by 1 + 0.1 ln 16) and
Llama 4's attention temperature (queries times 1 + 0.1 ln(floor(pos / 16) + 1): it changes every
16 positions of the 40-token prompt and the 32 tokens after). Exported as stored (Q8_0 kept), its
greedy tokens and every log-probability at LOGIT_STEPS equal llama.cpp's (tests/golden/
families.json, llama-server on the f32 copy) at 1 and 3 stages. YaRN elsewhere stays refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.pipeline.local import LocalPipeline
from tests.gguf_cases import CASES, LOGIT_STEPS, STEPS, Case
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import GOLDEN
from tests.helpers import greedy_ours

EXACT = RunConfig(precision="exact", threads=2)
YARN = {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 16.0,
        "{arch}.rope.scaling.original_context_length": 16, "{arch}.rope.scaling.yarn_beta_fast": 32.0,
        "{arch}.rope.scaling.yarn_beta_slow": 1.0, "{arch}.attention.temperature_scale": 0.1}
CASE = Case(FileSpec(name="mistral3-Q8_0", arch="mistral3", weights="Q8_0", layers=3, rope_theta=1e6,
                     extra_keys=YARN), prompt_len=40)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("mistral3"))


def test_the_file_reads_yarn_and_the_attention_temperature(mistral3: Path) -> None:
    arch = GGUFSource(mistral3).arch
    assert arch.family == "mistral3" and arch.rope_linear is None and arch.query_temperature == (pytest.approx(0.1), 16)
    assert arch.rope_yarn == {"factor": 16.0, "original_context": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": pytest.approx(1 + 0.1 * math.log(16))}


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(stages: int, mistral3: Path, tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())["files"][CASE.name]
    assert file_sha256(mistral3) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    folder = export(ExportConfig(out=tmp_path / "shards", model=mistral3, stages=stages, isolate=False,
                                 progress=False))
    with LocalPipeline(folder, EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    # llama-server gives no probabilities for a step whose token ends mid-character (one here)
    kept = [s for s in LOGIT_STEPS if str(s) in golden["logprobs"]]
    assert len(kept) >= 3
    for step in kept:
        ours = logits[step] - logits[step].max()
        ours = ours - np.log(np.exp(ours).sum())
        np.testing.assert_allclose(ours, golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_yarn_stays_refused_where_llama_cpp_would_not_read_its_keys(tmp_path: Path) -> None:
    spec = CASES["llama-Q8_0"].spec.with_(name="llama-yarn", extra_keys=YARN)
    path = Case(spec).write(tmp_path)
    with pytest.raises(ShardlineError, match="rope scaling 'yarn' is not supported"):
        GGUFSource(path)


def test_a_yarn_file_without_its_factor_is_refused(tmp_path: Path) -> None:
    keys = {k: v for k, v in YARN.items() if k != "{arch}.rope.scaling.factor"}
    path = Case(CASE.spec.with_(name="mistral3-no-factor", extra_keys=keys)).write(tmp_path)
    with pytest.raises(ShardlineError, match="YaRN needs mistral3.rope.scaling.factor > 0, got 0.0"):
        GGUFSource(path)
