"""The trained length predictor on live requests (issue 13). A prefill instance's pipeline
summarizes stage 0's output of every prompt chunk as it runs; the prediction a leaving stream
gets from that summary equals the offline one (features.py's extractor and the bundled model)
for the same prompt, on the stateful export and on the paged one (issue 56: each prompt chunk
of a ragged step, several prompts fused in it, summarized by slicing stage 0's flat output). A
one-stage export cannot summarize, and says so."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import replace
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
from shardline.pipeline.paged_local import PagedPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Request
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS, DEFAULT_SPLIT

EXACT = RunConfig(precision="exact", threads=1)
WAIT_S = 120.0
@pytest.mark.parametrize("paged", [False, True], ids=["stateful", "paged"])
def test_a_live_prediction_equals_the_offline_one(paged: bool, balanced: Path, shards: Callable[..., Path]) -> None:
    predictor = LengthPredictor.load(BUNDLED)
    folder = shards("gguf", layers=DEFAULT_SPLIT, paged=True) if paged else balanced
    predictor.check_fits(load_manifest(balanced))
    tok = ChatTokenizer(balanced)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    prompts.append(tok.encode_chat([{"role": "user", "content": " ".join(CHAT_PROMPTS) * 6}]))  # 3 chunks
    assert len(prompts[-1]) > 2 * DEFAULT_PREFILL_CHUNK
    moved: queue.Queue[Moving] = queue.Queue()
    with _summarizing(folder) as pipe:
        scheduler = None
        if isinstance(pipe, PagedPipeline):  # prompts fused: up to 4 chunks in one ragged step
            scheduler = PagedScheduler(SchedulerConfig(chunk=DEFAULT_PREFILL_CHUNK, max_prefills=4, pacing=None),
                                       BlockPool(pipe.blocks, pipe.block_size))
        engine = prefill_instance(pipe, Limits(4, 8), 4096, DEFAULT_PREFILL_CHUNK, moved.put,
                                  trained_predict(predictor), paged=scheduler).engine
        try:
            for p in prompts:
                engine.submit(Request(p, SamplingConfig(max_tokens=300), frozenset()), lambda ev: None)
            got = [moved.get(timeout=WAIT_S) for _ in prompts]
        finally:
            engine.stop()
    extract = FeatureExtractor(balanced)  # the stateful export's stage 0: the offline reference for both
    by_prompt = {tuple(m.stream.prompt): m for m in got}
    assert len(by_prompt) == len(prompts)
    for p in prompts:
        m, offline = by_prompt[tuple(p)], extract(p)
        assert m.stream.handover.hidden is not None and m.stream.handover.hidden.positions == len(p)
        np.testing.assert_allclose(m.stream.handover.hidden.vector(), offline, rtol=1e-4, atol=1e-3)
        assert m.predicted == predictor.predict(offline)
        assert m.stream.handover.expect == m.predicted.lo
    assert len({m.predicted for m in got}) > 1, "the model named one bucket for every prompt"


def _summarizing(folder: Path) -> LocalPipeline | PagedPipeline:
    if load_manifest(folder).stages[0].runner == "paged":
        return PagedPipeline(folder, replace(EXACT, context=4096), 256 << 20, summarize=True)
    return LocalPipeline(folder, EXACT, summarize=True)


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
    with pytest.raises(ShardlineError, match="one stage outputs logits, not hidden states"):
        PagedPipeline(shards("gguf", stages=1, paged=True), replace(EXACT, context=1024), 64 << 20, summarize=True)
    with pytest.raises(ShardlineError, match="a one-stage export has no stage-0 hidden states"):
        LengthPredictor.load(BUNDLED).check_fits(load_manifest(one))
