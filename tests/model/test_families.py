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


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
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
    head = 32 if arch.family == "qwen3" else 16  # Qwen3's head size is its own, not hidden / heads
    assert (arch.n_layers, arch.hidden, arch.n_heads, arch.n_kv_heads, arch.head_dim) == (6, 64, 4, 2, head)
    assert arch.qkv_bias == (arch.family == "qwen2")


@pytest.mark.parametrize("family,config", [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    ("mistral", {"sliding_window": 40}),
], ids=["llama-biases", "llama-rope-linear", "mistral-sliding-window"])
def test_architecture_variants_equal_transformers(family: str, config: dict[str, object], tmp_path: Path,
                                                  shards: Callable[..., Path]) -> None:
    """Biases on every linear, linear RoPE scaling, and Mistral's sliding window (the context is
    capped at the window, where sliding and full attention agree) give transformers' tokens."""
    folder = save_tiny_hf(tmp_path / family, family, seed=3, **config)
    source = open_source(folder)
    if "sliding_window" in config:
        assert (source.arch.max_context, source.arch.sliding_window) == (40, 40)
    if "rope_parameters" in config:
        assert source.arch.rope_linear == 4.0
    if "attention_bias" in config:
        assert source.arch.biases == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = reference_model(source)
    pipe = LocalPipeline(shards("fp32", stages=2, model=folder), EXACT)
    for prompt in PROMPTS[:2]:
        assert greedy_ours(pipe, prompt, 16)[0] == greedy_reference(model, prompt, 16)[0]


def test_mixture_of_experts_and_other_scalings_are_refused(tmp_path: Path) -> None:
    from shardline.errors import ShardlineError

    folder = save_tiny_hf(tmp_path / "moe", "mistral", num_local_experts=8)
    with pytest.raises(ShardlineError, match="mixture-of-experts models are not supported"):
        open_source(folder)
    folder = save_tiny_hf(tmp_path / "yarn", "llama",
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ShardlineError, match="unsupported rope scaling 'yarn'"):
        open_source(folder)
