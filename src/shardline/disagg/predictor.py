"""Run-time length prediction: which bucket [i*g, (i+1)*g) of generated tokens a request falls in.

`LengthPredictor` is a linear classifier over features.py's vector: standardize, then a
multinomial logistic regression (softmax of one affine score per bucket). It is trained
offline (length_train.py, scikit-learn) and shipped as one JSON file; applying it needs numpy
alone. Every field is checked on load, since the file crosses machines and a wrong one would
otherwise surface as a silent misprediction (or a NaN) deep in the dispatcher.

`Oracle` and `NoisyOracle` answer from the true decode length instead, for experiments that
separate the scheduler's gain from the predictor's accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardline.disagg.features import FEATURE_KIND, feature_size
from shardline.disagg.files import read_json
from shardline.disagg.state import LengthRange, bucket
from shardline.errors import ShardlineError
from shardline.model.manifest import Manifest

FORMAT = "shardline-length-predictor"
VERSION = 1
MAX_FILE_BYTES = 64 << 20  # a model of 1153 features and 24 buckets is ~0.6 MB
MAX_BUCKETS = 4096
# The model `serve --disaggregate` uses by default: trained by length_train.py on
# bench/data/lengths.jsonl (the default model, stage 0 of its default 2-stage export).
BUNDLED = Path(__file__).parent / "data" / "smollm2-135m-length-predictor.json"
MAX_FEATURES = 1 << 20


@dataclass(frozen=True, eq=False)  # arrays: identity, not an elementwise ==
class LengthPredictor:
    g: int  # bucket width in generated tokens
    buckets: int  # the last one is open: [(buckets - 1) * g, inf)
    mean: np.ndarray  # [F] standardizer
    scale: np.ndarray  # [F], > 0
    classes: np.ndarray  # [C] the buckets the classifier has a score for (those seen in training)
    coef: np.ndarray  # [C, F]
    intercept: np.ndarray  # [C]
    meta: dict[str, Any] = field(default_factory=dict)  # what the features are, the training report

    def __post_init__(self) -> None:
        _check_model(self)

    @property
    def features(self) -> int:
        return int(self.mean.shape[0])

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """P(bucket) for every bucket ([buckets], f64); buckets never seen in training get 0."""
        scores = self.coef @ ((self._checked(features) - self.mean) / self.scale) + self.intercept
        scores -= scores.max()  # softmax without overflow
        p = np.exp(scores)
        out = np.zeros(self.buckets)
        out[self.classes] = p / p.sum()
        return out

    def predict(self, features: np.ndarray) -> LengthRange:
        i = int(np.argmax(self.probabilities(features)))
        return bucket(i * self.g, self.g, self.buckets)

    def check_fits(self, manifest: Manifest) -> None:
        """Refuse (ShardlineError, saying why) an export whose stage 0 does not compute the
        features this model was trained on: another model, another stage-0 layer range (stage
        0's output is the features), or another feature kind."""
        if len(manifest.stages) < 2:
            raise ShardlineError("a one-stage export has no stage-0 hidden states for the length predictor")
        m, first = self.meta, manifest.stages[0]
        layers = [first.first_layer, first.last_layer]
        wanted = {"model_hash": manifest.model_hash, "features": FEATURE_KIND, "stage0_layers": layers,
                  "feature_size": feature_size(manifest.arch.hidden)}
        for name, value in wanted.items():
            if m.get(name) != value:
                raise ShardlineError(f"the length predictor was trained for {name} {m.get(name)!r:.80}; "
                                     f"this export has {value!r:.80}")
        if self.features != feature_size(manifest.arch.hidden):
            raise ShardlineError(f"the length predictor takes {self.features} features, not "
                                 f"{feature_size(manifest.arch.hidden)}")

    def _checked(self, features: np.ndarray) -> np.ndarray:
        x = np.asarray(features, np.float64)
        if x.shape != (self.features,) or not np.isfinite(x).all():
            raise ShardlineError(f"length predictor: expected {self.features} finite features, got shape {x.shape}")
        return x

    @classmethod
    def load(cls, path: Path) -> LengthPredictor:
        doc = read_json(path, "length predictor", MAX_FILE_BYTES)
        try:
            return cls.from_dict(doc)
        except ShardlineError as e:
            raise ShardlineError(f"length predictor {path}: {e}") from None

    @classmethod
    def from_dict(cls, doc: object) -> LengthPredictor:
        if not isinstance(doc, dict):
            raise ShardlineError("not a JSON object")
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ShardlineError(f"not a {FORMAT} file of version {VERSION}")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ShardlineError("meta must be an object")
        return cls(_int(doc, "g"), _int(doc, "buckets"), _floats(doc, "mean", 1), _floats(doc, "scale", 1),
                   _ints(doc, "classes"), _floats(doc, "coef", 2), _floats(doc, "intercept", 1), meta)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `load` reads (the writer writes it atomically)."""
        return {"format": FORMAT, "version": VERSION, "g": self.g, "buckets": self.buckets,
                "mean": self.mean.tolist(), "scale": self.scale.tolist(), "classes": self.classes.tolist(),
                "coef": self.coef.tolist(), "intercept": self.intercept.tolist(), "meta": self.meta}


def _check_model(m: LengthPredictor) -> None:
    """Shapes, ranges and finiteness: a model that passes gives finite probabilities."""
    if m.g < 1 or not 2 <= m.buckets <= MAX_BUCKETS:
        raise ShardlineError(f"need g >= 1 and 2-{MAX_BUCKETS} buckets, got g={m.g}, buckets={m.buckets}")
    f, c = m.mean.shape[0] if m.mean.ndim == 1 else 0, m.classes.shape[0] if m.classes.ndim == 1 else 0
    if not 1 <= f <= MAX_FEATURES or m.scale.shape != (f,):
        raise ShardlineError(f"mean and scale must be two equal vectors of 1-{MAX_FEATURES} features, "
                             f"got {m.mean.shape} and {m.scale.shape}")
    if not 2 <= c <= m.buckets or m.coef.shape != (c, f) or m.intercept.shape != (c,):
        raise ShardlineError(f"need 2-{m.buckets} classes with coef [classes, {f}] and intercept [classes], got "
                             f"classes {m.classes.shape}, coef {m.coef.shape}, intercept {m.intercept.shape}")
    if np.any(np.diff(m.classes) <= 0) or m.classes[0] < 0 or m.classes[-1] >= m.buckets:
        raise ShardlineError(f"classes must be increasing bucket indices below {m.buckets}, got {m.classes.tolist()}")
    for name in ("mean", "scale", "coef", "intercept"):
        if not np.isfinite(getattr(m, name)).all():
            raise ShardlineError(f"{name} holds a number that is not finite")
    if np.any(m.scale <= 0):
        raise ShardlineError("every scale must be > 0")


def _int(doc: dict[str, Any], name: str) -> int:
    v = doc.get(name)
    if type(v) is not int:  # not a bool, a float or a string
        raise ShardlineError(f"{name} must be an integer, got {v!r:.40}")
    return v


def _ints(doc: dict[str, Any], name: str) -> np.ndarray:
    v = doc.get(name)
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x < MAX_BUCKETS for x in v):
        raise ShardlineError(f"{name} must be a list of bucket indices")
    return np.asarray(v, np.int64)


def _floats(doc: dict[str, Any], name: str, ndim: int) -> np.ndarray:
    """A list (ndim 1) or a rectangular list of lists (ndim 2) of finite numbers, as f64."""
    v = doc.get(name)
    rows = v if ndim == 2 else [v]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise ShardlineError(f"{name} must be a non-empty {'list of lists' if ndim == 2 else 'list'} of numbers")
    if len({len(r) for r in rows}) != 1:
        raise ShardlineError(f"{name}: rows of different lengths")
    for r in rows:
        if not all(_finite(x) for x in r):
            raise ShardlineError(f"{name} holds a value that is not a finite number")
    out = np.asarray(rows, np.float64)
    return out if ndim == 2 else out[0]


def _finite(x: object) -> bool:
    """A JSON number that is a finite f64 (an int too large for one overflows: not finite)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Oracle:
    """The true decode length's own bucket (a perfect predictor)."""

    g: int
    buckets: int

    def __post_init__(self) -> None:
        if self.g < 1 or self.buckets < 1:
            raise ShardlineError(f"an oracle needs g >= 1 and buckets >= 1, got {self.g}, {self.buckets}")

    def predict(self, length: int) -> LengthRange:
        return bucket(length, self.g, self.buckets)


class NoisyOracle:
    """The true bucket with probability `accuracy`, else a neighbouring one (either side with
    equal chance where both exist): a predictor of a chosen accuracy whose mistakes are the near
    misses a real classifier makes. Draws come from `seed` alone, in call order."""

    def __init__(self, g: int, buckets: int, seed: int, accuracy: float) -> None:
        if not 0 <= accuracy <= 1:
            raise ShardlineError(f"a noisy oracle's accuracy must be in [0, 1], got {accuracy}")
        self.oracle = Oracle(g, buckets)
        self.accuracy = accuracy
        self._rng = np.random.default_rng(seed)

    def predict(self, length: int) -> LengthRange:
        true = self.oracle.predict(length)
        g, n = self.oracle.g, self.oracle.buckets
        right = self._rng.random() < self.accuracy  # drawn every call: call k's draw depends on k alone
        side = self._rng.random() < 0.5
        i = true.lo // g
        if right or n == 1:
            return true
        j = i - 1 if (side and i > 0) or i == n - 1 else i + 1
        return bucket(j * g, g, n)
