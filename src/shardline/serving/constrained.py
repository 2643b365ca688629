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
    unconstrained steps carry nothing. Rows never fail together: a row whose grammar cannot say
    what may follow has its `failure` set and its entries left free (its tokens are not used:
    the engine ends that stream alone), so the other rows' masks, and tokens, are as without it."""
    if all(c is None for c in constraints):
        return None
    rows: list[np.ndarray] = []
    which: list[int] = []
    for c, d in zip(constraints, drafts, strict=True):
        bits = None if c is None else _row_masks(c, list(d))
        if bits is None:
            which += [-1] * (len(d) + 1)
            continue
        which += range(sum(len(b) for b in rows), sum(len(b) for b in rows) + len(bits))
        rows.append(bits)
    return TokenMasks(np.concatenate(rows), np.asarray(which, np.int64)) if rows else None


def _row_masks(c: Constraint, drafts: list[int]) -> np.ndarray | None:
    """One row's masks, or None (free) when it has none yet or its grammar has failed."""
    if c.failure is not None:
        return None
    try:
        bits = c.masks(drafts)
    except Exception as e:  # noqa: BLE001 - whatever the grammar engine raises is this row's alone
        c.failure = brief(e)
        return None
    if bits is not None and not bits.any(axis=1).all():
        c.failure = "the grammar allows no token here: no output can satisfy it"
        return None
    return bits


def brief(e: BaseException) -> str:
    """An error's first line, cut short: a grammar engine's message may go on with its state
    and the whole grammar, which belong in no reply and no log."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else type(e).__name__
    return first[:200] + ("..." if len(first) > 200 else "")


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
