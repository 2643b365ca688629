"""The tiny draft/target pair (tests/tiny.py) for speculative decoding tests: both export, load
and generate the tokens transformers generates from the same folders; they share the
tokenizer; the target is peaked; the draft's greedy guesses are often, not always, the target's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.config import RunConfig
from shardline.model.manifest import load_manifest
from shardline.model.source import open_source
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from tests.helpers import greedy_ours
from tests.model.reference import greedy_reference, reference_model

EXACT = RunConfig(precision="exact")
LOGIT_ATOL = 2e-3
N_NEW = 8


def _prompt(folder: Path, text: str = "What is the capital of France?") -> list[int]:
    return ChatTokenizer(folder).encode_chat([{"role": "user", "content": text}])


def test_pair_exports_with_different_sizes_and_one_tokenizer(tiny_models: tuple[Path, Path]) -> None:
    target, draft = (load_manifest(f) for f in tiny_models)
    dims = [(m.arch.n_layers, m.arch.hidden, m.arch.n_heads, m.arch.n_kv_heads, m.arch.intermediate, m.arch.vocab)
            for m in (target, draft)]
    assert dims == [(4, 128, 4, 2, 256, 49152), (2, 64, 2, 1, 128, 49152)]
    assert [len(m.stages) for m in (target, draft)] == [1, 1] and target.weights == draft.weights == "fp32"
    assert target.model_hash != draft.model_hash
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny_models[0] / name).read_bytes() == (tiny_models[1] / name).read_bytes()
    assert ChatTokenizer(tiny_models[0]).eos_id == ChatTokenizer(tiny_models[1]).eos_id


@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_generates_what_transformers_generates(which: int, tiny_sources: tuple[Path, Path],
                                               tiny_models: tuple[Path, Path]) -> None:
    model = reference_model(open_source(tiny_sources[which]))  # transformers reads the folder itself
    prompt = _prompt(tiny_models[which])
    ref_tokens, ref_logits = greedy_reference(model, prompt, N_NEW)
    with LocalPipeline(tiny_models[which], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, prompt, N_NEW)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)


def test_target_is_peaked(tiny_models: tuple[Path, Path]) -> None:
    """Top-1 well above uniform (1/49152) at the first step, and most steps with mass on more
    than one token (what a top-k sampling test at temperature 1 needs)."""
    with LocalPipeline(tiny_models[0], EXACT) as pipe:
        _, logits = greedy_ours(pipe, _prompt(tiny_models[0]), 16)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = -np.sort(-p, axis=1)[:, :5]
    assert top[0, 0] > 0.3, top[0]
    assert top[:, 0].mean() > 0.5 and top[:, :5].sum(axis=1).min() > 0.5, top
    assert (top[:, 1] > 0.01).mean() >= 0.25, top  # a second choice worth sampling, often


@torch.no_grad()
def test_draft_guesses_are_often_but_not_always_the_targets(tiny_sources: tuple[Path, Path],
                                                            tiny_models: tuple[Path, Path]) -> None:
    """Along the target's greedy continuation, the draft's greedy next token is the target's at
    some positions and not at others: a speculative decoder sees both acceptances and rejections."""
    target, draft = (reference_model(open_source(f)) for f in tiny_sources)
    prompt = _prompt(tiny_models[0])
    tokens, _ = greedy_reference(target, prompt, 24)
    ids = torch.tensor([prompt + tokens])
    want = target(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
    guess = draft(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
    assert want.tolist() == tokens
    agree = (guess == want).float().mean().item()
    assert 0.3 <= agree < 1, agree
