"""Shards computed in f32 are token-for-token the reference on the same dequantized weights:
fp32 shards for 1, 2, 3 and 5 stages, and shards that keep the GGUF's own quantized blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardline.config import RunConfig
from shardline.model.source import open_source
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours
from tests.model.reference import greedy_reference, reference_model

N_NEW = 64
# f32 both sides, different summation orders: logits agree to this absolute tolerance
# (logits of this model span roughly -30..+30).
LOGIT_ATOL = 2e-3
EXACT = RunConfig(precision="exact")


@pytest.fixture(scope="module")
def reference_runs(shards: Callable[..., Path]) -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, reference tokens, reference logits) for each chat prompt, computed once."""
    tok = ChatTokenizer(shards("fp32", stages=1))
    model = reference_model(open_source(None))
    runs = []
    for text in CHAT_PROMPTS:
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        tokens, logits = greedy_reference(model, prompt, N_NEW)
        runs.append((prompt, tokens, logits))
    return runs


@pytest.mark.parametrize("weights,stages", [("fp32", 1), ("fp32", 2), ("fp32", 3), ("fp32", 5),
                                            ("gguf", 1), ("gguf", 3)])
def test_n_stages_match_reference(weights: str, stages: int, shards: Callable[..., Path],
                                  reference_runs: list) -> None:
    pipe = LocalPipeline(shards(weights, stages=stages), EXACT)
    assert len(pipe.stages) == stages
    for prompt, ref_tokens, ref_logits in reference_runs:
        tokens, logits = greedy_ours(pipe, prompt, N_NEW)
        assert tokens == ref_tokens
        np.testing.assert_allclose(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)


def test_explicit_uneven_layers_match_even_split(shards: Callable[..., Path], reference_runs: list) -> None:
    pipe = LocalPipeline(shards("fp32", layers="0-3,4-20,21-29"), EXACT)
    assert [(s.entry.first_layer, s.entry.last_layer) for s in pipe.stages] == [(0, 3), (4, 20), (21, 29)]
    prompt, ref_tokens, _ = reference_runs[0]
    assert greedy_ours(pipe, prompt, N_NEW)[0] == ref_tokens


def test_greedy_answer_says_paris(shards: Callable[..., Path], reference_runs: list) -> None:
    tok = ChatTokenizer(shards("fp32", stages=1))
    prompt, ref_tokens, _ = reference_runs[0]
    answer = tok.decode(ref_tokens[: ref_tokens.index(tok.eos_id)] if tok.eos_id in ref_tokens else ref_tokens)
    assert "Paris" in answer
