"""Choose tokens from logits rows: greedy, or temperature with top-k / top-p.

Randomness depends only on (seed, position in the stream): each choice draws from a generator
seeded with both, so a request gives the same tokens whatever the batching, the split of the
model, or a replay after a fault, and no sampler state lives anywhere between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.masks import TokenMasks, masked
from shardline.decoding.speculative import Drafted, dense, verify_draw
from shardline.errors import Unsampleable


@dataclass(frozen=True)
class Choice:
    """What the end of a pipeline sends back for one sampled position: a token and its
    log-probability under the model's own distribution (raw logits, temperature 1), the most
    likely alternatives when asked for, and the logits row only when asked for (~200 KB)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    logits: np.ndarray | None = field(default=None, compare=False, repr=False)  # [vocab] f32
    failed: int = -1  # an Unsampleable reason's code: no token could be chosen here (token is -1)

    @staticmethod
    def unsampleable(e: Unsampleable) -> Choice:
        return Choice(-1, 0.0, failed=e.code)

    @property
    def why(self) -> str:
        """Why no token was chosen ("" when one was)."""
        return Unsampleable.REASONS[self.failed] if self.failed >= 0 else ""


class BadLogits(Unsampleable):
    """Logits that are not all finite: no token can be chosen from them."""

    def __init__(self) -> None:
        super().__init__(0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def top_logprobs(logp: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The n most likely tokens of log-probabilities `logp`, most likely first."""
    if n <= 0:
        return ()
    top = np.argpartition(-logp, min(n, len(logp)) - 1)[:n]
    top = top[np.argsort(-logp[top], kind="stable")]
    return tuple((int(t), float(logp[t])) for t in top)


def probabilities(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution sampled from, after temperature, top-k and top-p (nucleus) filtering.
    The maximum is subtracted before dividing by the temperature, so a small temperature drives
    the others to -inf (probability 0) instead of overflowing the maximum to inf (NaN)."""
    x = logits.astype(np.float64)
    z = (x - x.max()) / p.temperature
    if p.top_k and p.top_k < z.shape[-1]:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(cum, p.top_p)) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def draw(probs: np.ndarray, seed: int, position: int) -> int:
    """One token from `probs`, by inverse CDF with a uniform drawn from (seed, position)."""
    u = np.random.default_rng([seed, position]).random()
    cum = np.cumsum(probs)
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), len(probs) - 1))


def log_normalizer(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): exponentials in f32 (the costly part, ~20x faster than f64 over a
    49k vocabulary; a verify step makes one choice per position of every row), summed in f64."""
    x = logits.astype(np.float32, copy=False)
    m = float(x.max())
    return m + float(np.log(np.exp(x - m).sum(dtype=np.float64)))


def _choice(logits: np.ndarray, token: int, p: SamplingParams, want_logits: bool) -> Choice:
    """The Choice of `token`: its log-probability, and the top alternatives only when asked (then
    all in f64, so that the token's figure and its entry among the alternatives agree)."""
    kept = logits.astype(np.float32, copy=True) if want_logits else None
    if not p.top_logprobs:
        return Choice(token, float(logits[token]) - log_normalizer(logits), (), kept)
    logp = log_softmax(logits)
    return Choice(token, float(logp[token]), top_logprobs(logp, p.top_logprobs), kept)


def choose(logits: np.ndarray, p: SamplingParams, position: int, want_logits: bool = False,
           allowed: np.ndarray | None = None) -> Choice:
    """The token at logical `position` of a stream, from the logits that predict it, among the
    `allowed` tokens (None: any). Its log-probability is the model's own, unconstrained."""
    if not np.isfinite(logits).all():
        raise BadLogits()
    x = masked(logits, allowed)
    token = int(np.argmax(x)) if p.greedy else draw(probabilities(x, p), p.seed, position)
    return _choice(logits, token, p, want_logits)


def verify(logits: np.ndarray, p: SamplingParams, position: int, draft: int, q_ids: np.ndarray,
           q_probs: np.ndarray, want_logits: bool = False, allowed: np.ndarray | None = None) -> Choice:
    """The token at `position` when a draft drawn from q (its support `q_ids`, `q_probs`) is
    offered there: speculative sampling's rule (decoding/speculative.py) over the `allowed`
    tokens' distribution (exact for any q); greedy takes the argmax."""
    if p.greedy:
        return choose(logits, p, position, want_logits, allowed)
    if not np.isfinite(logits).all():
        raise BadLogits()
    vocab = logits.shape[-1]
    if draft >= vocab or (q_ids.size and int(q_ids.max()) >= vocab):
        raise Unsampleable(2)
    x = masked(logits, allowed)
    token = verify_draw(probabilities(x, p), draft, dense(q_ids, q_probs, vocab), p.seed, position)
    return _choice(logits, token, p, want_logits)


def choose_at(logits: np.ndarray, sample_at: np.ndarray, pick: np.ndarray, position_ids: np.ndarray,
              params: list[SamplingParams], want_logits: bool = False, drafted: Drafted | None = None,
              masks: TokenMasks | None = None) -> list[Choice]:
    """A choice per (row, t) of `sample_at`, from the last stage's logits [B, N, V] gathered by
    `stage.cache.logits_index` (column `pick[e]` of row r); the token chosen after new token t
    sits at logical position position_ids[r, t] + 1. Where `drafted` offers a draft drawn from
    a distribution, the choice verifies it; where `masks` limits an entry, it chooses among the
    tokens its mask allows. An entry no token can be chosen for fails alone (`entry`)."""
    out = []
    for e, (r, t) in enumerate(sample_at.tolist()):
        position = int(position_ids[r, t]) + 1
        out.append(entry(logits[r, pick[e]], params[r], position, e, want_logits, drafted, masks))
    return out


def entry(row: np.ndarray, p: SamplingParams, position: int, e: int, want_logits: bool, drafted: Drafted | None,
          masks: TokenMasks | None) -> Choice:
    """Entry `e`'s choice from its logits `row`: verified against its draft when one was drawn
    from a distribution, among its mask's tokens when it has one. Entries share a step, never a
    fate: one whose logits or mask leave nothing to choose is a failed Choice for its stream to
    end with, and the step's other entries are chosen as if it were not there."""
    allowed = masks.allowed(e, row.shape[-1]) if masks is not None else None
    try:
        if drafted is not None and drafted.tokens[e] >= 0:
            return verify(row, p, position, int(drafted.tokens[e]), drafted.q_ids[e], drafted.q_probs[e],
                          want_logits, allowed)
        return choose(row, p, position, want_logits, allowed)
    except Unsampleable as why:
        return Choice.unsampleable(why)
