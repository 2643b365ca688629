"""What a drafter hands the verify step, and how a draft model's token is drawn (pure numpy).

Drafts are certain (greedy, lookup) or, when the stream samples and the drafter is a model,
drawn from the draft's own distribution q, truncated to its `SUPPORT` most likely tokens (the
verify rule is exact for any q, and only q's support travels to the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.sampler import probabilities
from shardline.decoding.speculative import Drafted, uniform

SUPPORT = 16  # q's most likely tokens kept (renormalized): what a sampled draft sends per position
_DRAFT = 3  # the use of randomness a draft draw takes at a position (see decoding/speculative.py)


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    q_ids: np.ndarray | None = None  # [k, S] i64: where each draft was drawn from (None: certain)
    q_probs: np.ndarray | None = None  # [k, S] f32


NO_DRAFTS = Proposal([])


class Drafter(Protocol):
    cost_s: float  # measured seconds per drafted token (0 for lookup)

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal: ...
    def ready(self, context: list[int]) -> int: ...
    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Draw:
    token: int
    ids: np.ndarray  # q's support (the token alone when greedy)
    probs: np.ndarray


def proposal(drafts: list[Draw], params: SamplingParams) -> Proposal:
    tokens = [d.token for d in drafts]
    if params.greedy or not drafts:
        return Proposal(tokens)
    return Proposal(tokens, np.stack([d.ids for d in drafts]), np.stack([d.probs for d in drafts]).astype(np.float32))


def draw(logits: np.ndarray, params: SamplingParams, position: int) -> Draw:
    """A draft token: the argmax when the stream is greedy, else drawn from q (the draft's own
    distribution under the stream's sampling, truncated to its SUPPORT most likely tokens)."""
    if params.greedy:
        token = int(np.argmax(logits))
        return Draw(token, np.array([token], np.int64), np.ones(1, np.float32))
    p = probabilities(logits, params)
    ids = np.argsort(-p, kind="stable")[:SUPPORT]
    q = p[ids] / p[ids].sum()
    cum = np.cumsum(q)
    j = int(min(np.searchsorted(cum, uniform(params.seed, position, _DRAFT) * cum[-1], side="right"), len(ids) - 1))
    ids = np.where(q > 0, ids, -1)  # a support narrower than SUPPORT: padded, probability 0
    return Draw(int(ids[j]), ids.astype(np.int64), q)


def drafted(proposals: list[Proposal]) -> Drafted | None:
    """The drafted entries of a step whose row r feeds [last, *proposals[r].tokens] and samples
    after each position: the draft offered there and q's support, -1 where none is (the last
    position of a row, and certain drafts); None when no row's drafts were drawn from a q."""
    drawn = [p.q_ids for p in proposals if p.q_ids is not None]
    if not drawn:
        return None
    width = max(q.shape[1] for q in drawn)
    tokens: list[int] = []
    ids, probs = [], []
    for p in proposals:
        k = len(p.tokens)
        for t in range(k + 1):
            if t < k and p.q_ids is not None and p.q_probs is not None:
                tokens.append(p.tokens[t])
                ids.append(np.pad(p.q_ids[t], (0, width - p.q_ids.shape[1]), constant_values=-1))
                probs.append(np.pad(p.q_probs[t], (0, width - p.q_probs.shape[1])))
            else:
                tokens.append(-1)
                ids.append(np.full(width, -1, np.int64))
                probs.append(np.zeros(width, np.float32))
    return Drafted(np.asarray(tokens, np.int64), np.stack(ids).astype(np.int64), np.stack(probs).astype(np.float32))
