"""KV bookkeeping: physical slots vs logical positions, and the mask."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.stage.cache import KVBook


def _step(book: KVBook, tokens: list[int]) -> tuple[list[int], list[int]]:
    inputs = book.plan(tokens)
    book.commit(inputs)
    return inputs.attention_mask[0].tolist(), inputs.position_ids[0].tolist()


def test_prefill_then_decode_grow_mask_and_positions() -> None:
    book = KVBook()
    assert _step(book, [5, 6, 7]) == ([1, 1, 1], [0, 1, 2])
    assert _step(book, [8]) == ([1, 1, 1, 1], [3])
    assert (book.slots, book.position) == (4, 4)


def test_chunks_continue_where_the_last_ended() -> None:
    book = KVBook()
    _step(book, [1, 2])
    assert _step(book, [3, 4, 5]) == ([1, 1, 1, 1, 1], [2, 3, 4])


def test_plan_does_not_change_state_until_commit() -> None:
    book = KVBook()
    inputs = book.plan([1, 2])
    assert inputs.input_ids.tolist() == [[1, 2]] and inputs.input_ids.dtype == np.int64
    assert (book.slots, book.position) == (0, 0)


def test_masked_drafts_stay_masked_and_positions_step_back() -> None:
    book = KVBook()
    _step(book, [1, 2])
    _step(book, [3, 4, 5])  # e.g. a correction plus two drafts
    book.mask_last(2)  # both drafts rejected
    assert (book.slots, book.position) == (5, 3)
    mask, pos = _step(book, [9])
    assert mask == [1, 1, 1, 0, 0, 1] and pos == [3]
    book.mask_last(2)  # skips already-masked slots: masks the live slots 2 and 5
    assert book.plan([1]).attention_mask[0].tolist() == [1, 1, 0, 0, 0, 0, 1]
    assert book.position == 2


def test_mask_last_rejects_more_than_seen() -> None:
    book = KVBook()
    _step(book, [1])
    with pytest.raises(ValueError):
        book.mask_last(2)


def test_reset() -> None:
    book = KVBook()
    _step(book, [1, 2, 3])
    book.reset()
    assert (book.slots, book.position) == (0, 0)
