"""The length predictor's features and dataset on the real default model: stage 0's summary is
deterministic, fixed-size and tells prompts apart; the dataset's lengths are the engine's own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from shardline_tools.lengths import length_data

from shardline.config import RunConfig, SamplingConfig, ServeConfig
from shardline.disagg.features import FeatureExtractor, feature_size, prompt_features
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_engine
from shardline.serving.generate import tokens
from tests.conftest import CHAT_PROMPTS


@pytest.fixture(scope="module")
def folder(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


def _chat(tok: ChatTokenizer, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def test_features_are_deterministic_fixed_size_and_differ_between_prompts(folder: Path) -> None:
    tok, extract = ChatTokenizer(folder), FeatureExtractor(folder)
    short, long = _chat(tok, CHAT_PROMPTS[0]), _chat(tok, " ".join(CHAT_PROMPTS) * 8)  # 1 and 3 chunks of 128
    a, b = extract(short), extract(long)
    assert a.shape == b.shape == (feature_size(576),) == (extract.size,) and a.dtype == np.float32
    assert np.isfinite(a).all() and np.isfinite(b).all()
    assert np.array_equal(a, extract(short)) and np.array_equal(a, FeatureExtractor(folder)(short))
    other = extract(_chat(tok, CHAT_PROMPTS[1]))
    assert np.abs(a - other).max() > 1e-2 and np.abs(a - b).max() > 1e-2
    assert not extract.runner.keys()  # every prompt's key was closed
    # Smaller chunks (as a prefill instance might run) give the same summary up to rounding.
    np.testing.assert_allclose(prompt_features(extract.runner, long, chunk=16), b, rtol=1e-3, atol=1e-3)


def test_the_dataset_holds_the_lengths_the_engine_generates(folder: Path, tmp_path: Path) -> None:
    out, cap = tmp_path / "lengths.jsonl", 24
    assert length_data.main(["--shards", str(folder), "--out", str(out), "--prompts", "3",
                             "--max-tokens", str(cap), "--concurrency", "3", "--time-limit", "120"]) == 0
    header, records = length_data.read_dataset(out)
    assert header["max_tokens"] == cap and header["answered"] == len(records) == 3
    first = load_manifest(folder).stages[0]
    assert header["stage0_layers"] == [first.first_layer, first.last_layer]  # what a predictor must fit
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed
    tok, extract = ChatTokenizer(folder), FeatureExtractor(folder)
    engine, _ = open_engine(folder, RunConfig(precision="exact"), ServeConfig(max_streams=1, max_queue=0))
    try:
        for r in records:
            ids = _chat(tok, r["prompt"])
            made = tokens(engine, ids, SamplingConfig(max_tokens=cap), tok.stop_ids)
            assert (r["length"], r["finish"], r["prompt_tokens"]) == (
                len(made), "length" if len(made) == cap else "stop", len(ids)), r["prompt"]
            assert np.array_equal(r["x"], extract(ids))
    finally:
        engine.stop()
        engine.pipe.shutdown()
    assert {r["finish"] for r in records} == {"stop", "length"}  # both ends of a request are covered
