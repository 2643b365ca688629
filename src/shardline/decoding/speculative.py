"""Speculative decoding's two rules, as pure functions over tokens and distributions.

Verify: the target runs [last accepted token, d1..dk] in one step and chooses a token after
each position; draft d(i+1) stands when it equals the target's choice after position i. The
longest run of standing drafts is accepted, plus the target's own token after it (the
correction, or a bonus token when every draft stood): a verify step yields 1 to k+1 tokens.

Sampling (temperature > 0), the rule of Leviathan et al. and Chen et al.: at a position with a
draft d drawn from q, the target keeps d with probability min(1, p(d) / q(d)); otherwise it
draws from the residual max(0, p - q), normalized. The result is distributed exactly as p,
whatever q is, so a draft may be drawn from any distribution (a truncated one keeps what
travels small: only q's support goes to the last stage). A rejected draft can never be drawn
again from the residual (its residual mass is 0), so "the target's choice equals the draft"
means "accepted" in both modes.

Randomness: each draw comes from a generator seeded with (seed, position, use), so what a
position gets depends only on the stream's seed, the position and the draft offered there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_ACCEPT, _RESIDUAL = 1, 2  # the uses of randomness at one position, besides plain sampling (0)


@dataclass(frozen=True)
class Drafted:
    """Drafts drawn from distributions, one entry per sampled (row, t) of a step, in order: the
    draft offered after that position (-1: none) and the support of the distribution it was
    drawn from (ids padded with -1, probabilities with 0). Certain drafts (greedy, prompt
    lookup) need none of this: plain sampling at each position, then equality, is the same rule
    when q puts all its mass on the draft."""

    tokens: np.ndarray  # [E] i64
    q_ids: np.ndarray  # [E, S] i64
    q_probs: np.ndarray  # [E, S] f32


def accepted(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """How many leading drafts stand: draft i (0-based) is checked against the target's choice
    after the position before it, choices[i]."""
    n = 0
    for d, c in zip(drafts, choices, strict=False):
        if d != c:
            break
        n += 1
    return n


def dense(ids: np.ndarray, probs: np.ndarray, vocab: int) -> np.ndarray:
    """A draft distribution given by its support (ids with their probabilities) as a vector."""
    q = np.zeros(vocab, np.float64)
    keep = ids >= 0  # -1 pads a support narrower than the widest of its step
    np.add.at(q, ids[keep], probs[keep].astype(np.float64))
    return q


def uniform(seed: int, position: int, use: int) -> float:
    return float(np.random.default_rng([seed, position, use]).random())


def verify_draw(p: np.ndarray, draft: int, q: np.ndarray, seed: int, position: int) -> int:
    """The target's token at `position` given draft `draft` drawn from `q` (both over the whole
    vocabulary; `p` is the target's distribution after its own temperature and filters)."""
    qd = q[draft]
    if qd <= 0:
        raise ValueError(f"draft {draft} is outside the support of the distribution it was drawn from")
    if uniform(seed, position, _ACCEPT) * qd < p[draft]:  # u < p(d) / q(d), without dividing
        return draft
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p <= q everywhere means p == q: the draft was kept above with probability 1
        return draft
    cum = np.cumsum(residual)
    u = uniform(seed, position, _RESIDUAL)
    return int(min(np.searchsorted(cum, u * total, side="right"), len(p) - 1))
