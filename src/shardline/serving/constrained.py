"""Constrained streams in the scheduler's terms (issue 40): a step's token masks from its rows'
grammar states, and drafts cut where they leave the grammar. Pure over the streams' constraints
(decoding/masks.Constraint); the grammar engine behind them lives in decoding/grammar.py."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardline.decoding.drafts import Proposal
from shardline.decoding.masks import Constraint, LateMasks, TokenMasks


def token_masks(constraints: Sequence[Constraint | None], drafts: Sequence[Sequence[int]]) -> TokenMasks | None:
    """The masks of a step whose row r feeds [last, *drafts[r]] and samples after each position
    (a prefill's last chunk: no drafts, one entry). None when no row is constrained, so
    unconstrained steps carry nothing."""
    if all(c is None for c in constraints):
        return None
    rows: list[np.ndarray] = []
    which: list[int] = []
    for c, d in zip(constraints, drafts, strict=True):
        bits = None if c is None else c.masks(list(d))
        if bits is None:
            which += [-1] * (len(d) + 1)
            continue
        which += range(sum(len(b) for b in rows), sum(len(b) for b in rows) + len(bits))
        rows.append(bits)
    return TokenMasks(np.concatenate(rows), np.asarray(which, np.int64)) if rows else None


def late_masks(constraints: Sequence[Constraint | None], drafts: Sequence[Sequence[int]]) -> LateMasks | None:
    """`token_masks` of a step, computed when first asked (decoding/masks.LateMasks: in process,
    while the step runs); None at once when no row has a constraint."""
    if all(c is None for c in constraints):
        return None
    held, fed = list(constraints), [list(d) for d in drafts]
    return LateMasks(lambda: token_masks(held, fed))


def within_grammar(constraint: Constraint | None, proposal: Proposal) -> Proposal:
    """`proposal` cut before its first draft the grammar does not allow (verification would
    reject it anyway; cut, it costs no position and no mask)."""
    if constraint is None or not proposal.tokens:
        return proposal
    n = constraint.valid(proposal.tokens)
    if n == len(proposal.tokens):
        return proposal
    q_ids, q_probs = proposal.q_ids, proposal.q_probs
    return Proposal(proposal.tokens[:n], None if q_ids is None else q_ids[:n], None if q_probs is None else q_probs[:n])
