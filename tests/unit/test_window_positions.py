"""The invariant sliding-window layers rely on (export/graph.py `within`): in every step's mask,
an attended slot's logical position is the count of attended slots before it. Whatever a KV
book goes through (prompt chunks, decode steps, right pads of a group row, left pads of a group
state, rejected drafts masked, compaction), the positions the graph derives from the mask alone
are the positions the slots' tokens were fed at."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.stage.cache import KVBook

OPS = st.lists(st.one_of(
    st.tuples(st.just("feed"), st.integers(1, 6), st.integers(0, 3)),  # tokens, right pads
    st.tuples(st.just("reject"), st.integers(0, 4), st.just(0)),  # the last accepted tokens masked
    st.tuples(st.just("pad_left"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("compact"), st.just(0), st.just(0)),
), min_size=1, max_size=30)


def derived(mask: np.ndarray) -> np.ndarray:
    """What the graph computes: the running count of attended slots, less one."""
    return np.cumsum(mask) - 1


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_positions_derived_from_the_mask_are_the_tokens_positions(ops: list[tuple[str, int, int]]) -> None:
    book = KVBook()
    held: list[int] = []  # per physical slot: the position its token was fed at (-1: a pad)
    for op, n, pads in ops:
        if op == "feed":
            step = book.plan(list(range(n)), pad=pads)
            mask, positions = step.attention_mask[0], step.position_ids[0]
            new = mask[-(n + pads):]
            keys = derived(mask)
            # Every attended key (past and new) sits at the position its token holds; each new
            # token's query position is its own key position.
            assert [int(k) for k, m in zip(keys[:-(n + pads)], mask, strict=False) if m] == [p for p in held if p >= 0]
            assert list(keys[-(n + pads):][new == 1]) == list(positions[:n])
            book.commit(step)
            held += list(positions[:n]) + [-1] * pads
        elif op == "reject" and n <= book.position:
            live = [i for i, p in enumerate(held) if p >= 0]
            book.mask_last(n)
            for i in live[len(live) - n:]:
                held[i] = -1
        elif op == "pad_left":
            book.pad_left(n)
            held = [-1] * n + held
        elif op == "compact":
            index = book.compact()[0]
            held = [held[i] if i < len(held) else -1 for i in index]
            held = [p if book_mask else -1 for p, book_mask in zip(held, _mask(book), strict=True)]
    assert [p for p in held if p >= 0] == list(range(book.position))


def _mask(book: KVBook) -> np.ndarray:
    return book.plan([0]).attention_mask[0][:-1]
