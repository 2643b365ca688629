"""The length predictor without the model: its file is checked field by field (corrupt and
hostile files are one clear ShardlineError), the numpy predictor gives scikit-learn's own
probabilities, the oracles (the noisy one seeded, at the accuracy asked), bucket edges."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from shardline_tools.lengths.length_data import decode_features, encode_features, make_prompts
from shardline_tools.lengths.length_train import bucket_count, choose_g, labels, to_predictor
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from shardline.config import SamplingParams
from shardline.disagg import predictor as pred
from shardline.disagg.features import FEATURE_KIND
from shardline.disagg.predictor import LengthPredictor, NoisyOracle, Oracle
from shardline.disagg.prefill import trained_predict
from shardline.disagg.state import LengthRange, bucket
from shardline.errors import ShardlineError
from shardline.pipeline.hidden import HiddenChunk, PromptHidden, ragged_chunks
from shardline.serving.stream import Handover, Stream


def _doc(**changes: Any) -> dict[str, Any]:
    """A valid model file: 3 features, 5 buckets of 16, scores for buckets 0, 1 and 4."""
    doc: dict[str, Any] = {"format": pred.FORMAT, "version": pred.VERSION, "g": 16, "buckets": 5,
                           "mean": [0.0, 1.0, -1.0], "scale": [1.0, 2.0, 0.5], "classes": [0, 1, 4],
                           "coef": [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
                           "intercept": [0.0, 0.5, -0.5], "meta": {"features": "test"}}
    return doc | changes


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.json"
    path.write_text(text)
    return path


def test_a_valid_file_loads_and_predicts_a_bucket(tmp_path: Path) -> None:
    m = LengthPredictor.load(_write(tmp_path, json.dumps(_doc())))
    p = m.probabilities(np.array([0.0, 1.0, -1.0]))
    assert p.shape == (5,) and p[[2, 3]].tolist() == [0.0, 0.0] and p.sum() == pytest.approx(1.0)
    assert m.predict(np.array([0.0, 1.0, -1.0])) == LengthRange(16, 32)  # the 0.5 intercept wins
    assert m.predict(np.array([0.0, 1.0, 9.0])) == LengthRange(64, None)  # bucket 4: the open last one
    assert m.meta == {"features": "test"}


HOSTILE: list[tuple[str, str]] = [
    ("not json", "{not json"),
    ("truncated", json.dumps(_doc())[:-20]),
    ("a list", "[1, 2, 3]"),
    ("no format", json.dumps(_doc(format="other"))),
    ("a newer version", json.dumps(_doc(version=2))),
    ("g zero", json.dumps(_doc(g=0))),
    ("g negative", json.dumps(_doc(g=-16))),
    ("g a bool", json.dumps(_doc(g=True))),
    ("g a float", json.dumps(_doc(g=16.0))),
    ("g a string", json.dumps(_doc(g="16"))),
    ("one bucket", json.dumps(_doc(buckets=1, classes=[0], coef=[[1.0, 0.0, 0.0]], intercept=[0.0]))),
    ("too many buckets", json.dumps(_doc(buckets=pred.MAX_BUCKETS + 1))),
    ("a class past the buckets", json.dumps(_doc(classes=[0, 1, 5]))),
    ("classes out of order", json.dumps(_doc(classes=[1, 0, 4]))),
    ("a repeated class", json.dumps(_doc(classes=[0, 0, 4]))),
    ("a negative class", json.dumps(_doc(classes=[-1, 0, 4]))),
    ("classes of bools", json.dumps(_doc(classes=[False, True, 4]))),
    ("coef with a row missing", json.dumps(_doc(coef=[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))),
    ("ragged coef", json.dumps(_doc(coef=[[1.0, 0.0, 0.0], [0.0, 1.0], [0.0, 0.0, 1.0]]))),
    ("coef flat", json.dumps(_doc(coef=[1.0, 0.0, 0.0]))),
    ("scale shorter than mean", json.dumps(_doc(scale=[1.0, 2.0]))),
    ("a zero scale", json.dumps(_doc(scale=[1.0, 0.0, 0.5]))),
    ("a negative scale", json.dumps(_doc(scale=[1.0, -2.0, 0.5]))),
    ("empty mean", json.dumps(_doc(mean=[]))),
    ("a string in intercept", json.dumps(_doc(intercept=[0.0, "0.5", -0.5]))),
    ("a bool in mean", json.dumps(_doc(mean=[0.0, True, -1.0]))),
    ("NaN", json.dumps(_doc()).replace("0.5, -0.5", "NaN, -0.5")),
    ("Infinity", json.dumps(_doc()).replace("[1.0, 2.0, 0.5]", "[1.0, Infinity, 0.5]")),
    ("an overflowing float", json.dumps(_doc()).replace("[0.0, 1.0, -1.0]", "[0.0, 1e999, -1.0]", 1)),
    ("an overflowing int", json.dumps(_doc()).replace("[0.0, 1.0, -1.0]", f"[0.0, {10**400}, -1.0]", 1)),
    ("meta not an object", json.dumps(_doc(meta=[1]))),
    ("nested without end", "[" * 100_000 + "]" * 100_000),
    ("empty", ""),
]


@pytest.mark.parametrize("text", [t for _, t in HOSTILE], ids=[n for n, _ in HOSTILE])
def test_a_corrupt_or_hostile_file_is_one_clear_error(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ShardlineError, match="length predictor") as e:
        LengthPredictor.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_or_oversized_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ShardlineError, match="cannot read"):
        LengthPredictor.load(tmp_path / "absent.json")
    monkeypatch.setattr(pred, "MAX_FILE_BYTES", 100)
    with pytest.raises(ShardlineError, match="larger than 100 bytes"):
        LengthPredictor.load(_write(tmp_path, json.dumps(_doc())))


def test_features_of_the_wrong_shape_or_not_finite_are_refused() -> None:
    m = LengthPredictor.from_dict(_doc())
    for bad in (np.zeros(4), np.zeros((1, 3)), np.array([0.0, np.nan, 0.0]), np.array([np.inf, 0.0, 0.0])):
        with pytest.raises(ShardlineError, match="3 finite features"):
            m.predict(bad)


def _synthetic(classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features whose class shows in a few directions (and noise in the rest), scales far apart."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, 400)
    x = rng.normal(size=(400, 12)) * np.geomspace(0.01, 100, 12)
    x[:, :classes] += 3 * np.eye(classes)[y] * np.geomspace(0.01, 100, 12)[:classes]
    return x, y


@pytest.mark.parametrize(("classes", "used"), [(3, [0, 1, 2]), (4, [0, 2, 3, 5]), (2, [1, 3])],
                         ids=["three buckets", "a bucket never seen", "two classes"])
def test_the_numpy_predictor_gives_sklearns_probabilities(tmp_path: Path, classes: int, used: list[int]) -> None:
    x, y = _synthetic(classes)
    y = np.asarray(used)[y]  # bucket indices; with gaps, the unseen buckets get probability 0
    model = make_pipeline(StandardScaler(), LogisticRegression(C=0.5, max_iter=2000)).fit(x, y)
    path = _write(tmp_path, json.dumps(to_predictor(model, 32, 6, {}).to_dict()))
    loaded = LengthPredictor.load(path)
    ours = np.stack([loaded.probabilities(row) for row in x[:50]])
    np.testing.assert_allclose(ours[:, used], model.predict_proba(x[:50]), atol=1e-9)
    assert np.all(np.delete(ours, used, axis=1) == 0)
    assert [loaded.predict(row) for row in x[:50]] == [bucket(int(c) * 32, 32, 6) for c in model.predict(x[:50])]


def test_the_oracle_returns_the_true_bucket_the_last_one_open() -> None:
    o = Oracle(32, 4)
    assert [o.predict(n) for n in (0, 31, 32, 95, 96, 5000)] == [
        LengthRange(0, 32), LengthRange(0, 32), LengthRange(32, 64), LengthRange(64, 96), LengthRange(96, None),
        LengthRange(96, None)]
    with pytest.raises(ShardlineError):
        Oracle(0, 4)


@pytest.mark.parametrize("accuracy", [0.0, 0.5, 0.75, 0.9, 1.0])
def test_the_noisy_oracle_is_right_as_often_as_asked_and_else_one_bucket_off(accuracy: float) -> None:
    g, n = 16, 6
    lengths = np.random.default_rng(1).integers(0, 200, 20_000).tolist()
    noisy, truth = NoisyOracle(g, n, seed=7, accuracy=accuracy), Oracle(g, n)
    got = [(noisy.predict(x).lo // g, truth.predict(x).lo // g) for x in lengths]
    right = np.mean([a == b for a, b in got])
    assert abs(right - accuracy) < 0.015
    assert all(abs(a - b) <= 1 and 0 <= a < n for a, b in got)  # a mistake is a neighbour
    edge = [a for a, b in got if b == 0 and a != b]
    assert set(edge) <= {1}  # bucket 0 has one neighbour
    assert {a for a, b in got if b == n - 1 and a != b} <= {n - 2}


def test_the_noisy_oracle_is_seeded() -> None:
    draws = [[NoisyOracle(16, 6, seed=s, accuracy=0.5).predict(40) for _ in range(200)] for s in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]
    with pytest.raises(ShardlineError):
        NoisyOracle(16, 6, seed=0, accuracy=1.5)


def test_training_labels_are_the_buckets_of_state_bucket_at_every_edge() -> None:
    cap = 384
    for g in (1, 16, 32, 64, 100, 128, 383):
        n = bucket_count(g, cap)
        assert bucket(cap, g, n).hi is None  # a capped answer (true length >= cap) lands in the open bucket
        edges = [0, g - 1, g, 2 * g - 1, 2 * g, cap - 1, cap]
        assert labels(np.asarray(edges), g, n).tolist() == [bucket(x, g, n).lo // g for x in edges]
    for g in (0, cap, 500):  # every answer in one bucket: nothing to learn
        with pytest.raises(ShardlineError, match="bucket width"):
            bucket_count(g, cap)


def test_g_is_the_widest_whose_largest_bucket_holds_at_most_half() -> None:
    short = np.asarray([10] * 40 + [40] * 30 + [100] * 30)  # g=128: 100% in bucket 0; g=64: 70%; g=32: 40%
    assert choose_g(short, 384) == 32
    assert choose_g(np.asarray([5] * 100), 384) == 16  # none fits: the narrowest
    assert choose_g(np.asarray([10] * 50 + [300] * 50), 384) == 128


def test_a_hidden_summary_over_chunks_is_the_mean_the_last_and_the_length() -> None:
    h = np.random.default_rng(0).normal(size=(1, 10, 8)).astype(np.float32)
    s = PromptHidden(8)
    for a, b in ((0, 3), (3, 4), (4, 10)):
        s.add(HiddenChunk.of(h[:, a:b]))
    v = s.vector()
    assert v.dtype == np.float32 and v.shape == (17,)
    np.testing.assert_allclose(v[:8], h[0].mean(axis=0), rtol=1e-6)
    assert v[8:16].tolist() == h[0, -1].tolist() and v[16] == pytest.approx(np.log1p(10))
    with pytest.raises(ShardlineError, match="width"):
        s.add(HiddenChunk.of(np.zeros((1, 2, 7), np.float32)))
    for shape in ((2, 10), (2, 3, 8), (1, 0, 8)):
        with pytest.raises(ShardlineError, match=r"expected \[1, T, H\]"):
            HiddenChunk.of(np.zeros(shape, np.float32))
    with pytest.raises(ShardlineError, match="no prompt positions"):
        PromptHidden(8).vector()
    assert s.vector(10).tolist() == v.tolist()
    rest = PromptHidden(8)  # a prompt that started from a kept prefix of 6: stage 0 ran the rest
    rest.add(HiddenChunk.of(h[:, 6:]))
    w = rest.vector(10)
    np.testing.assert_allclose(w[:8], h[0, 6:].mean(axis=0), rtol=1e-6)
    assert w[8:16].tolist() == v[8:16].tolist() and w[16] == v[16]  # its last position and its length
    with pytest.raises(ShardlineError, match="a prompt of 3 positions of which 4 were summarized"):
        rest.vector(3)


def test_a_ragged_steps_prompt_chunks_are_summarized_each_from_its_slice() -> None:
    """Issue 56: a paged stage 0's output holds every sequence's tokens end to end; each prompt
    chunk is summarized from its own rows, a decode token not at all."""
    out = np.random.default_rng(1).normal(size=(9, 4)).astype(np.float32)
    begins = np.array([0, 5, 6, 9], np.int32)  # a prompt chunk of 5, a decode token, a prompt chunk of 3
    got = ragged_chunks((11, 12, 13), (True, False, True), begins, out)
    assert sorted(got) == [11, 13]
    for stream, (a, b) in ((11, (0, 5)), (13, (6, 9))):
        assert got[stream].positions == b - a and got[stream].last.tolist() == out[b - 1].tolist()
        np.testing.assert_allclose(got[stream].total, out[a:b].sum(axis=0, dtype=np.float64))
    for bad_out, bad_begins in ((out[:8], begins), (out[None], begins), (out, begins[:3])):
        with pytest.raises(ShardlineError, match="stage 0's output of shape"):
            ragged_chunks((11, 12, 13), (True, False, True), bad_begins, bad_out)


def test_features_survive_the_dataset_encoding_exactly() -> None:
    v = np.random.default_rng(0).normal(size=33).astype(np.float32)
    assert decode_features(encode_features(v), 33).tolist() == v.tolist()
    nan = encode_features(np.array([np.nan], np.float32))
    for bad, size in (("not base64!", 33), (encode_features(v), 32), (nan, 1)):
        with pytest.raises(ShardlineError):
            decode_features(bad, size)


def test_prompts_are_distinct_seeded_and_of_every_kind() -> None:
    a, b, c = make_prompts(240, 0), make_prompts(240, 0), make_prompts(240, 1)
    assert a == b != c and len({p.text for p in a}) == 240
    assert len({p.kind for p in a}) >= 8 and len({p.topic for p in a}) >= 40


def _export(stages: list[tuple[int, int]], hidden: int = 1, model_hash: str = "h") -> Any:
    """What check_fits reads of a manifest: the model, its width and the stages' layer ranges."""
    return SimpleNamespace(model_hash=model_hash, arch=SimpleNamespace(hidden=hidden),
                           stages=[SimpleNamespace(first_layer=a, last_layer=b) for a, b in stages])


FITTED = {"model_hash": "h", "features": FEATURE_KIND, "stage0_layers": [0, 18], "feature_size": 3}


def test_a_model_fits_only_the_export_whose_stage_0_made_its_features() -> None:
    m = LengthPredictor.from_dict(_doc(meta=FITTED))
    m.check_fits(_export([(0, 18), (19, 29)]))  # 3 features = 2 * hidden 1 + 1
    refused = [
        (_export([(0, 29)]), "a one-stage export has no stage-0 hidden states"),
        (_export([(0, 14), (15, 29)]), "trained for stage0_layers [0, 18]; this export has [0, 14]"),
        (_export([(0, 18), (19, 29)], model_hash="other"), "trained for model_hash 'h'; this export has 'other'"),
        (_export([(0, 18), (19, 29)], hidden=2), "trained for feature_size 3; this export has 5"),
    ]
    for manifest, said in refused:
        with pytest.raises(ShardlineError) as e:
            m.check_fits(manifest)
        assert said in str(e.value)
    for meta in ({**FITTED, "features": "other-kind"}, {k: v for k, v in FITTED.items() if k != "stage0_layers"}):
        with pytest.raises(ShardlineError, match="the length predictor was trained for"):
            LengthPredictor.from_dict(_doc(meta=meta)).check_fits(_export([(0, 18), (19, 29)]))


def _stream(hidden: PromptHidden | None, max_tokens: int = 100) -> Stream:
    return Stream(7, [1, 2, 3], SamplingParams(), max_tokens, handover=Handover(hidden=hidden))


def test_a_trained_prediction_reads_the_streams_stage_0_summary() -> None:
    m = LengthPredictor.from_dict(_doc(meta=FITTED))
    predict = trained_predict(m)
    seen = PromptHidden(1)
    seen.add(HiddenChunk.of(np.zeros((1, 4, 1), np.float32)))  # features [0, 0, log 5]: bucket 4 wins
    assert m.predict(seen.vector()) == LengthRange(64, None)
    assert predict(_stream(seen)) == LengthRange(64, None)


def test_a_stream_without_usable_features_is_predicted_its_max_tokens(caplog: pytest.LogCaptureFixture) -> None:
    predict = trained_predict(LengthPredictor.from_dict(_doc(meta=FITTED)))
    nan = PromptHidden(1)
    nan.add(HiddenChunk.of(np.full((1, 2, 1), np.nan, np.float32)))
    wide = PromptHidden(2)
    wide.add(HiddenChunk.of(np.zeros((1, 2, 2), np.float32)))
    with caplog.at_level("WARNING", logger="shardline.disagg"):
        assert predict(_stream(None, max_tokens=40)) == LengthRange(32, 48)  # bucket of 40, g=16
        assert predict(_stream(nan, max_tokens=5)) == LengthRange(0, 16)
        assert predict(_stream(wide, max_tokens=500)) == LengthRange(64, None)
    said = [r.getMessage() for r in caplog.records]
    assert "no stage-0 summary of its prompt" in said[0] and "expected 3 finite features" in said[1]
    assert "got shape (5,)" in said[2]
