"""Decode-group bookkeeping and the KV merge, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.pipeline.groups import Group, least_loaded, merged
from shardline.stage.cache import Decode, KVBook, Prefill, StepInputs


def test_least_loaded_prefers_fewest_then_lowest_index() -> None:
    assert least_loaded([2, 1, 1]) == 1
    assert least_loaded([0, 0]) == 0
    assert least_loaded([3, 2, 5]) == 1


def test_least_loaded_skips_full_groups() -> None:
    assert least_loaded([8, 3], max_rows=8) == 1
    assert least_loaded([2, 2], max_rows=2) is None  # all full: the pipeline opens a new group
    assert least_loaded([]) is None


def test_group_completes_when_every_member_submitted() -> None:
    g = Group(key=-1, rows=[4, 7], held=[4, 7], joining=[9])
    assert not g.complete()
    g.ready = {4: 1, 7: 2}
    assert not g.complete()  # the joiner has not submitted yet
    g.ready[9] = 3
    assert g.complete()
    g.leave(7)
    assert g.members() == [4, 9] and g.ready == {4: 1, 9: 3} and g.complete()
    assert g.kept() == [0]  # row 0 of the state stays; row 1 (stream 7) is dropped by beam_idx
    assert not Group(key=-2).complete()  # an empty group never launches


def _kv(rows: int, slots: int, fill: float) -> dict[str, np.ndarray]:
    a = np.full((rows, 3, slots, 2), fill, np.float32)
    return {"k": a, "v": -a}


def test_merge_left_pads_every_row_to_the_longest() -> None:
    batch = {"k": np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 2)}
    batch["v"] = -batch["k"]
    joiner = _kv(1, 6, 9.0)
    state, width = merged(batch, [1], [joiner], slots=4, joiner_slots=[6])
    assert width == 6
    assert state["k"].shape == (2, 3, 6, 2)
    np.testing.assert_array_equal(state["k"][0, :, 2:], batch["k"][1])  # kept row 1, padded by 2
    np.testing.assert_array_equal(state["k"][0, :, :2], 0)
    np.testing.assert_array_equal(state["v"][1], -joiner["k"][0])  # the joiner, no padding


def test_merge_pads_a_shorter_joiner() -> None:
    state, width = merged(_kv(2, 5, 1.0), [0, 1], [_kv(1, 2, 7.0)], slots=5, joiner_slots=[2])
    assert width == 5 and state["k"].shape == (3, 3, 5, 2)
    np.testing.assert_array_equal(state["k"][2, :, :3], 0)
    np.testing.assert_array_equal(state["k"][2, :, 3:], 7.0)


def test_pad_left_keeps_masks_in_step_and_positions_logical() -> None:
    long, short = KVBook(), KVBook()
    long.commit(long.plan(Prefill([1, 2, 3, 4, 5])))
    short.commit(short.plan(Prefill([1, 2])))
    short.pad_left(long.slots - short.slots)
    rows = [long.plan(Decode(8)), short.plan(Decode(9))]
    batch = StepInputs.stack(rows, np.array([0, 1], np.int32))
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[5], [2]]  # padding moves slots, not positions
    assert batch.input_ids.tolist() == [[8], [9]]
    with pytest.raises(ValueError):
        StepInputs.stack([long.plan(Prefill([1])), KVBook().plan(Prefill([1]))])  # masks differ in length
