"""The trained length predictor on live requests (issue 13). A prefill instance's pipeline
summarizes stage 0's output of every prompt chunk as it runs; the prediction a leaving stream
gets from that summary equals the offline one (features.py's extractor and the bundled model)
for the same prompt. A one-stage export cannot summarize, and says so."""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig, SamplingConfig
from shardline.disagg.features import FeatureExtractor
from shardline.disagg.predictor import BUNDLED, LengthPredictor
from shardline.disagg.prefill import Moving, prefill_instance, trained_predict
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Request
from tests.conftest import CHAT_PROMPTS

EXACT = RunConfig(precision="exact", threads=1)
WAIT_S = 120.0
def test_a_live_prediction_equals_the_offline_one(balanced: Path) -> None:
    predictor = LengthPredictor.load(BUNDLED)
    predictor.check_fits(load_manifest(balanced))
    tok = ChatTokenizer(balanced)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    prompts.append(tok.encode_chat([{"role": "user", "content": " ".join(CHAT_PROMPTS) * 6}]))  # 3 chunks
    assert len(prompts[-1]) > 2 * DEFAULT_PREFILL_CHUNK
    moved: queue.Queue[Moving] = queue.Queue()
    with LocalPipeline(balanced, EXACT, summarize=True) as pipe:
        engine = prefill_instance(pipe, Limits(4, 8), 4096, DEFAULT_PREFILL_CHUNK, moved.put,
                                  trained_predict(predictor)).engine
        try:
            for p in prompts:
                engine.submit(Request(p, SamplingConfig(max_tokens=300), frozenset()), lambda ev: None)
            got = [moved.get(timeout=WAIT_S) for _ in prompts]
        finally:
            engine.stop()
    extract = FeatureExtractor(balanced)
    by_prompt = {tuple(m.stream.prompt): m for m in got}
    assert len(by_prompt) == len(prompts)
    for p in prompts:
        m, offline = by_prompt[tuple(p)], extract(p)
        assert m.stream.handover.hidden is not None and m.stream.handover.hidden.positions == len(p)
        np.testing.assert_allclose(m.stream.handover.hidden.vector(), offline, rtol=1e-4, atol=1e-3)
        assert m.predicted == predictor.predict(offline)
        assert m.stream.handover.expect == m.predicted.lo
    assert len({m.predicted for m in got}) > 1, "the model named one bucket for every prompt"


def test_a_pipeline_that_does_not_summarize_carries_no_summary(balanced: Path) -> None:
    tok = ChatTokenizer(balanced)
    moved: queue.Queue[Moving] = queue.Queue()
    with LocalPipeline(balanced, EXACT) as pipe:
        engine = prefill_instance(pipe, Limits(1, 1), 4096, DEFAULT_PREFILL_CHUNK, moved.put,
                                  trained_predict(LengthPredictor.load(BUNDLED))).engine
        try:
            engine.submit(Request(tok.encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}]),
                                  SamplingConfig(max_tokens=300), frozenset()), lambda ev: None)
            m = moved.get(timeout=WAIT_S)
        finally:
            engine.stop()
    assert m.stream.handover.hidden is None
    assert m.predicted.lo == 256  # max_tokens' bucket: the fallback


def test_one_stage_cannot_summarize(shards: Callable[..., Path]) -> None:
    one = shards("gguf", stages=1)
    with pytest.raises(ShardlineError, match="one stage outputs logits, not hidden states"):
        LocalPipeline(one, EXACT, summarize=True)
    with pytest.raises(ShardlineError, match="a one-stage export has no stage-0 hidden states"):
        LengthPredictor.load(BUNDLED).check_fits(load_manifest(one))
