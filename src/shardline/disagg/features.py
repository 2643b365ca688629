"""The length predictor's input: a summary of the hidden state stage 0 computes for a prompt.

A prefill instance runs stage 0 over every prompt anyway, so a predictor that reads stage 0's
output costs no model of its own (TetriInfer fine-tunes a separate small LM for this). The
summary is fixed-size whatever the prompt's length, f32:

- the mean over the prompt's positions of stage 0's output (what the prompt is about),
- its last position's (the state the answer starts from: after the chat template's
  "assistant" turn, it has attended to the whole prompt),
- log(1 + prompt tokens) (longer inputs, e.g. a text to summarize, change the answer's length).

The summary is pipeline/hidden.py's, which a prefill instance's pipeline makes of the chunks it
runs: offline (here, stage 0 compiled on its own) and live, a prompt gets the same vector.
numpy and openvino only: this runs on serving nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest
from shardline.pipeline.hidden import HiddenChunk, PromptHidden
from shardline.stage.cache import KVBook
from shardline.stage.runners import Stage, open_stage

FEATURE_KIND = "stage0-mean-last-loglen"  # recorded with datasets and models: what the vector is


def feature_size(hidden: int) -> int:
    return 2 * hidden + 1


class _Key:
    """A key of its own per prompt: equal to no other, so a runner the engine also uses (whose
    keys are ints) never confuses the two."""

    def __repr__(self) -> str:
        return "features"


def prompt_features(runner: Stage, tokens: Sequence[int], chunk: int = DEFAULT_PREFILL_CHUNK) -> np.ndarray:
    """Run stage 0 (`runner`) over `tokens` as the engine prefills them (chunks of `chunk`
    tokens, one fresh KV state, freed afterwards) and return the summary vector."""
    if not runner.entry.has_embedding or runner.entry.has_head:
        raise ShardlineError(f"features need stage 0 of a multi-stage export (token ids in, hidden states out); "
                             f"{runner.entry.name} is not")
    if not tokens or chunk < 1:
        raise ShardlineError(f"features need a non-empty prompt and a chunk >= 1, got {len(tokens)} tokens")
    key, book, summary = _Key(), KVBook(), None
    runner.open(key)
    try:
        for start in range(0, len(tokens), chunk):
            inputs = book.plan(list(tokens[start:start + chunk]))
            out = runner.run(key, inputs)
            book.commit(inputs)
            summary = summary or PromptHidden(int(out.shape[-1]))
            summary.add(HiddenChunk.of(out))
    finally:
        runner.close(key)
    assert summary is not None
    return summary.vector()


class FeatureExtractor:
    """Stage 0 of an export compiled for features alone (its own InferRequests), exact precision
    by default so that a prompt's vector does not depend on the machine's plugin defaults."""

    def __init__(self, folder: Path, run: RunConfig | None = None, chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        manifest = load_manifest(folder)
        self.model_hash = manifest.model_hash
        self.size = feature_size(manifest.arch.hidden)
        self.chunk = chunk
        run = run or RunConfig(precision="exact")
        self.runner = open_stage(folder, manifest.stages[0], replace(run, device=run.devices[0]),
                                  vocab=manifest.arch.vocab)

    def __call__(self, tokens: Sequence[int]) -> np.ndarray:
        return prompt_features(self.runner, tokens, self.chunk)
