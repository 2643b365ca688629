"""Tiny random-config models of every supported family, from Hugging Face folders: N stages
equal one stage and equal transformers, token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.model.source import open_source
from shardline.pipeline.local import LocalPipeline
from tests.helpers import greedy_ours
from tests.model.reference import greedy_reference, reference_model, save_tiny_hf

PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 7], list(range(10, 40))]
EXACT = RunConfig(precision="exact")


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp(request.param), request.param)


def test_tiny_family_n_stages_equal_one_and_reference(tiny: Path, shards: Callable[..., Path]) -> None:
    source = open_source(tiny)
    model = reference_model(source)
    pipes = [LocalPipeline(shards("fp32", stages=n, model=tiny), EXACT) for n in (1, 2, 3)]
    for prompt in PROMPTS:
        ref = greedy_reference(model, prompt, 24)[0]
        assert [greedy_ours(p, prompt, 24)[0] for p in pipes] == [ref, ref, ref]


def test_tiny_family_arch_is_read_from_config(tiny: Path) -> None:
    arch = open_source(tiny).arch
    assert (arch.n_layers, arch.hidden, arch.n_heads, arch.n_kv_heads, arch.head_dim) == (6, 64, 4, 2, 16)
    assert arch.qkv_bias == (arch.family == "qwen2")
