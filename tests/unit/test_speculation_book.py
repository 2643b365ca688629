"""Speculation's bookkeeping, simulated: after any sequence of verify steps (accepts, rejects),
pads of a group's shorter rows and compactions, the slots a step attends are exactly the
accepted tokens, in order, at logical positions 0, 1, 2, ... (what plain decoding would have)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.stage.cache import KVBook, StepInputs, compaction


class Cache:
    """What a stage's cache holds for one row: (token, position) per physical slot."""

    def __init__(self) -> None:
        self.slots: list[tuple[int, int]] = []

    def run(self, inputs: StepInputs, row: int = 0) -> None:
        self.slots += list(zip(inputs.input_ids[row].tolist(), inputs.position_ids[row].tolist(), strict=True))

    def compact(self, index: np.ndarray, row: int = 0) -> None:
        self.slots = [self.slots[i] for i in index[row].tolist()]


def attended(cache: Cache, mask: np.ndarray) -> list[tuple[int, int]]:
    return [s for s, m in zip(cache.slots, mask.tolist(), strict=True) if m]


verify_steps = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 3), st.booleans()),
                        min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 6), steps=verify_steps)
def test_attended_slots_are_the_accepted_text_after_any_accepts_rejects_pads_and_compactions(
        prompt: int, steps: list[tuple[int, int, int, bool]]) -> None:
    book, cache = KVBook(), Cache()
    text = list(range(100, 100 + prompt))  # the accepted text; its last token is fed next
    first = book.plan(text)
    cache.run(first)
    book.commit(first)
    text.append(999)  # the token the prefill chose
    next_id = 1000
    for k, kept, pad, compact in steps:
        kept = min(kept, k)
        drafts = list(range(next_id, next_id + k))
        next_id += k
        inputs = book.plan([text[-1], *drafts], pad)
        if compact:
            index, run = inputs.compacted()
            cache.compact(index)
        else:
            run = inputs
        # the step attends what came before it, then its own tokens
        past = attended(cache, run.attention_mask[0, : len(cache.slots)])
        assert [p for _, p in past] == list(range(len(past)))
        assert [t for t, _ in past] == text[:-1]
        cache.run(run)
        book.commit(run)
        assert book.slots == len(cache.slots)
        book.mask_last(k - kept)
        text += drafts[:kept] + [next_id + 500]  # the drafts that stood, then the target's token
        assert book.position == len(text) - 1
    final = attended(cache, book.plan([text[-1]]).attention_mask[0, : book.slots])
    assert [t for t, _ in final] == text[:-1]
    assert [p for _, p in final] == list(range(len(text) - 1))


def test_compaction_keeps_each_rows_attended_slots_right_aligned() -> None:
    mask = np.array([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0], [1, 1, 1, 1, 1]], np.int64)
    index, after = compaction(mask)
    assert index.tolist() == [[0, 0, 0, 2, 3], [0, 0, 0, 0, 3], [0, 1, 2, 3, 4]]
    assert after.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    index, after = compaction(np.array([[1, 0, 0, 1]], np.int64))
    assert (index.tolist(), after.tolist()) == ([[0, 3]], [[1, 1]])


def test_a_compacting_step_keeps_its_new_tokens_and_positions() -> None:
    book = KVBook()
    book.commit(book.plan([1, 2, 3, 4]))
    book.mask_last(2)
    inputs = book.plan([9, 8], pad=1)
    assert inputs.attention_mask.tolist() == [[1, 1, 0, 0, 1, 1, 0]]
    assert inputs.position_ids.tolist() == [[2, 3, 4]] and inputs.input_ids.tolist() == [[9, 8, 8]]
    index, run = inputs.compacted()
    assert index.tolist() == [[0, 1]] and run.attention_mask.tolist() == [[1, 1, 1, 1, 0]]
    assert run.position_ids.tolist() == [[2, 3, 4]]
    book.commit(run)
    assert (book.slots, book.masked, book.position) == (5, 1, 4)


def test_a_padded_row_advances_by_its_own_tokens_only() -> None:
    book = KVBook()
    book.commit(book.plan([1, 2]))
    book.commit(book.plan([3], pad=3))
    assert (book.slots, book.masked, book.position) == (6, 3, 3)


def test_the_book_compacts_itself() -> None:
    book = KVBook()
    book.commit(book.plan([1, 2, 3]))
    book.mask_last(1)
    assert book.compact().tolist() == [[0, 1]]
    assert (book.slots, book.masked, book.position) == (2, 0, 2)


def test_masking_more_than_was_accepted_is_refused() -> None:
    book = KVBook()
    book.commit(book.plan([1]))
    with pytest.raises(ValueError, match="cannot mask 2 tokens of 1"):
        book.mask_last(2)
