"""Train the length predictor offline (scikit-learn) and write it as the JSON predictor.py loads.

    python -m shardline_tools.lengths.length_train --data FILE --out MODEL.json

For each candidate bucket width g: the buckets are [i*g, (i+1)*g), as many as it takes for the
open last bucket to hold the dataset's max_tokens cap (answers that reached it are censored:
their true length is at least the cap, so they can only be placed in that last bucket). A
StandardScaler + multinomial LogisticRegression is fitted on a seeded training split, its
regularization C chosen by 5-fold cross-validation within that split, and scored on the
held-out prompts: accuracy, the majority bucket's accuracy (the training split's most common
bucket predicted for every prompt: the trivial predictor to beat), and within-one-bucket
accuracy (the prediction is the true bucket or a neighbour).

How g is chosen, from the model's own output lengths (training split only, so the held-out
prompts play no part): the largest candidate g whose most common bucket holds at most half the
training answers. A g so wide that one bucket holds most answers (g=200 on this model's short
chat answers would put most of them in bucket 0) makes the trivial predictor nearly as good as
any, and tells the scheduler little; a narrower g than needed only splits what the features can
hardly tell apart. If every candidate fails the rule, the narrowest is taken.

The model written is then refitted on every prompt (training and held-out) with the chosen g
and its C; the accuracies reported are those of the training-split fit on the held-out prompts.
scikit-learn is imported here alone: serving nodes apply the model with numpy (predictor.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sklearn
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, KFold, train_test_split
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from shardline.disagg.files import write_text_atomic
from shardline.disagg.predictor import LengthPredictor
from shardline.errors import ShardlineError
from shardline_tools.lengths.length_data import read_dataset

CANDIDATE_G = (16, 32, 64, 128)
C_GRID = (1e-4, 1e-3, 1e-2, 1e-1)  # many features (1153) for few prompts: strong L2 (weaker ones never won)
MAX_SHARE = 0.5  # the g rule: no bucket may hold more than this share of the training answers
HELD_OUT = 0.25


def bucket_count(g: int, cap: int) -> int:
    """Buckets for width g when answers stop at `cap`: the last (open) one starts at or below it.
    A g of the cap or more would put every answer, capped or not, in one bucket."""
    if not 1 <= g < cap:
        raise ShardlineError(f"a bucket width must be in 1-{cap - 1} for answers capped at {cap} tokens, got {g}")
    return -(-cap // g)


def labels(lengths: np.ndarray, g: int, buckets: int) -> np.ndarray:
    """Each length's bucket index, as state.bucket places it (the last bucket open)."""
    return np.minimum(lengths // g, buckets - 1)


def choose_g(lengths: np.ndarray, cap: int, candidates: tuple[int, ...] = CANDIDATE_G,
             max_share: float = MAX_SHARE) -> int:
    """The largest candidate g whose most common bucket holds <= max_share of `lengths`."""
    fit = [g for g in candidates
           if np.bincount(labels(lengths, g, bucket_count(g, cap))).max() <= max_share * len(lengths)]
    return max(fit) if fit else min(candidates)


@dataclass(frozen=True)
class Scores:
    g: int
    buckets: int
    c: float
    accuracy: float
    majority: float
    within_one: float
    largest_share: float  # of the training answers, in the most common bucket


def fit(x: np.ndarray, y: np.ndarray, seed: int, c: float | None = None) -> Pipeline:
    """StandardScaler + LogisticRegression; C by 5-fold cross-validation unless given."""
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    with warnings.catch_warnings():
        # A fold may miss a rare bucket, and a weakly regularized fold may stop at max_iter:
        # both are part of what cross-validation weighs, not errors.
        warnings.simplefilter("ignore", (UserWarning, ConvergenceWarning))
        if c is not None:
            return model.set_params(logisticregression__C=c).fit(x, y)
        search = GridSearchCV(model, {"logisticregression__C": list(C_GRID)},
                              cv=KFold(5, shuffle=True, random_state=seed))
        return search.fit(x, y).best_estimator_


def score(g: int, cap: int, x: np.ndarray, lengths: np.ndarray, train: np.ndarray, test: np.ndarray,
          seed: int) -> Scores:
    buckets = bucket_count(g, cap)
    y = labels(lengths, g, buckets)
    model = fit(x[train], y[train], seed)
    predicted = model.predict(x[test])
    counts = np.bincount(y[train], minlength=buckets)
    return Scores(g, buckets, float(model.get_params()["logisticregression__C"]),
                  float(np.mean(predicted == y[test])), float(np.mean(y[test] == counts.argmax())),
                  float(np.mean(np.abs(predicted - y[test]) <= 1)), float(counts.max() / len(train)))


def to_predictor(model: Pipeline, g: int, buckets: int, meta: dict[str, Any]) -> LengthPredictor:
    """The fitted pipeline as predictor.py's arrays. A two-class LogisticRegression keeps one
    score row w (P(second) = sigmoid(w.x + b)); as softmax rows that is [-w/2, w/2]."""
    scaler, lr = model.named_steps["standardscaler"], model.named_steps["logisticregression"]
    coef, intercept = lr.coef_, lr.intercept_
    if coef.shape[0] == 1:
        coef, intercept = np.vstack([-coef / 2, coef / 2]), np.concatenate([-intercept / 2, intercept / 2])
    return LengthPredictor(g, buckets, scaler.mean_, scaler.scale_, lr.classes_.astype(np.int64), coef, intercept,
                           meta)


def _check_export(model: Pipeline, predictor: LengthPredictor, x: np.ndarray) -> None:
    """The numpy predictor must give sklearn's own probabilities (a few rows suffice)."""
    ours = np.stack([predictor.probabilities(row)[predictor.classes] for row in x[:16]])
    if not np.allclose(ours, model.predict_proba(x[:16]), atol=1e-6):
        raise ShardlineError("the exported predictor disagrees with scikit-learn's probabilities")


def _table(rows: list[Scores], chosen: int) -> str:
    head = f"{'g':>4} {'buckets':>7} {'C':>7} {'accuracy':>8} {'majority':>8} {'within-1':>8} {'top share':>9}"
    lines = [f"{s.g:>4} {s.buckets:>7} {s.c:>7g} {s.accuracy:>8.3f} {s.majority:>8.3f} {s.within_one:>8.3f} "
             f"{s.largest_share:>9.3f}{'  <- chosen' if s.g == chosen else ''}" for s in rows]
    return "\n".join([head, *lines])


def train(data: Path, seed: int, candidates: tuple[int, ...]) -> tuple[LengthPredictor, list[Scores]]:
    header, records = read_dataset(data)
    if len(records) < 20:
        raise ShardlineError(f"{data}: {len(records)} answered prompts; training needs at least 20")
    x = np.stack([r["x"] for r in records]).astype(np.float64)
    lengths = np.asarray([r["length"] for r in records])
    cap = int(header["max_tokens"])
    train_idx, test_idx = train_test_split(np.arange(len(records)), test_size=HELD_OUT, random_state=seed)
    rows = [score(g, cap, x, lengths, train_idx, test_idx, seed) for g in candidates]
    g = choose_g(lengths[train_idx], cap, candidates)
    best = next(s for s in rows if s.g == g)
    model = fit(x, labels(lengths, g, best.buckets), seed, best.c)
    meta = {"features": header.get("features"), "feature_size": header.get("feature_size"),
            "model_hash": header.get("model_hash"), "stage0_layers": header.get("stage0_layers"),
            "max_tokens": cap, "chunk": header.get("chunk"),
            "dataset_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "prompts": len(records),
            "seed": seed, "held_out": HELD_OUT, "g_rule": f"largest g with no bucket over {MAX_SHARE} of answers",
            "scores": [asdict(s) for s in rows], "sklearn": sklearn.__version__}
    predictor = to_predictor(model, g, best.buckets, meta)
    _check_export(model, predictor, x)
    return predictor, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardline_tools.lengths.length_train",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a dataset of length_data")
    ap.add_argument("--out", type=Path, required=True, help="the model file (JSON)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--g", default=",".join(map(str, CANDIDATE_G)), help="candidate bucket widths, comma-separated")
    a = ap.parse_args(argv)
    try:
        candidates = tuple(sorted({int(v) for v in a.g.split(",")}))
    except ValueError:
        raise ShardlineError(f"--g must be comma-separated integers, got {a.g!r}") from None
    if not candidates or min(candidates) < 1:
        raise ShardlineError("--g needs at least one width, each >= 1")
    predictor, rows = train(a.data, a.seed, candidates)
    write_text_atomic(a.out, json.dumps(predictor.to_dict()))
    print(_table(rows, predictor.g))
    print(f"chose g={predictor.g} ({predictor.buckets} buckets): {predictor.meta['g_rule']}; wrote {a.out}")
    print(json.dumps({"chosen_g": predictor.g, "scores": [asdict(s) for s in rows]}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ShardlineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
