"""Chunk-level KV transfer's slices (pipeline/kv.py): consecutive slices of a key's cache join
into the whole cache, bit for bit; slices that leave a gap, overlap, start past 0 or come from
another export, row count or layout are refused; a slice alone never imports or hands off."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.errors import ShardlineError
from shardline.pipeline.kv import KvSnapshot, StageKv, StageLayout, check, frozen, handoff, join, snapshot
from shardline.stage.cache import KVBook

rng = np.random.default_rng(7)
NAMES = ("past.0.key", "past.0.value")


def _whole(slots: int, rows: int = 1, dtype: type = np.float32) -> KvSnapshot:
    parts = [StageKv(a, b, frozen({n: rng.standard_normal((rows, 3, slots, 8)).astype(dtype) for n in NAMES}))
             for a, b in ((0, 0), (1, 1))]
    return snapshot("model/gguf/64", parts)


def _slice(whole: KvSnapshot, start: int, stop: int) -> KvSnapshot:
    parts = [StageKv(p.first_layer, p.last_layer, frozen({n: a[:, :, start:stop].copy() for n, a in p.arrays.items()}))
             for p in whole.stages]
    return snapshot(whole.export, parts, start)


def test_consecutive_slices_join_into_the_whole_cache() -> None:
    whole = _whole(300)
    cuts = [(0, 128), (128, 256), (256, 300)]
    joined = join([_slice(whole, a, b) for a, b in cuts])
    assert (joined.start, joined.slots, joined.rows, joined.export) == (0, 300, 1, whole.export)
    for got, want in zip(joined.stages, whole.stages, strict=True):
        assert (got.first_layer, got.last_layer) == (want.first_layer, want.last_layer)
        for n in NAMES:
            assert np.array_equal(got.arrays[n], want.arrays[n]) and not got.arrays[n].flags.writeable
    assert join([whole]) is whole
    assert join([_slice(whole, 0, 300)]).slots == 300


@pytest.mark.parametrize("cuts, said", [
    ([(0, 128), (129, 300)], "one starts at slot 129, expected 128"),  # a gap
    ([(0, 128), (100, 300)], "one starts at slot 100, expected 128"),  # an overlap
    ([(128, 300)], "one starts at slot 128, expected 0"),  # the first chunk missing
    ([(0, 128), (256, 300), (128, 256)], "one starts at slot 256, expected 128"),  # out of order
])
def test_slices_that_do_not_follow_each_other_are_refused(cuts: list[tuple[int, int]], said: str) -> None:
    whole = _whole(300)
    with pytest.raises(ShardlineError, match=said):
        join([_slice(whole, a, b) for a, b in cuts])


def test_slices_of_different_exports_rows_or_layouts_are_refused() -> None:
    head = _slice(_whole(300), 0, 128)
    others = [
        _slice(KvSnapshot("other/gguf/64", 1, 300, _whole(300).stages), 128, 300),
        _slice(_whole(300, rows=2), 128, 300),
        _slice(_whole(300, dtype=np.float16), 128, 300),
    ]
    for tail in others:
        with pytest.raises(ShardlineError, match="different exports, rows or state layouts"):
            join([head, tail])
    with pytest.raises(ShardlineError, match="no KV slices"):
        join([])


def test_a_slice_is_neither_imported_nor_handed_off() -> None:
    whole = _whole(64)
    tail = _slice(whole, 32, 64)
    layout = [StageLayout(p.first_layer, p.last_layer, {n: (np.dtype(np.float32), 3, 8) for n in NAMES})
              for p in whole.stages]
    check(whole, whole.export, layout)
    with pytest.raises(ShardlineError, match="a KV slice from slot 32 cannot be imported"):
        check(tail, whole.export, layout)
    book = KVBook()
    book.commit(book.plan(list(range(32))))
    with pytest.raises(ShardlineError, match="one stream's state has one row"):
        handoff(tail, book)
