"""Decode-group bookkeeping and the KV merge, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.pipeline.groups import Group, Launch, apply_merge, least_loaded, merged
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
    plan = g.launch()
    # row 0 of the state stays, row 1 (stream 7) goes, the joiner is appended after it
    assert plan == Launch(-1, [4, 9], [1, 3], [0], [9])
    assert plan.beam_idx is None  # a merge rebuilds the state: no Gather needed
    assert g.rows == g.held == [4, 9] and g.joining == [] and g.ready == {}
    g.leave(4)  # a stream leaving while the step runs: the running step's rows stay as planned
    assert plan.rows == [4, 9] and g.rows == [9]
    assert not g.complete()
    assert not Group(key=-2).complete()  # an empty group never launches


def test_leaving_without_joiners_is_a_beam_gather() -> None:
    g = Group(key=-1, rows=[4, 7, 8], held=[4, 7, 8], ready={4: 1, 7: 2, 8: 3})
    g.leave(7)
    plan = g.launch()
    assert plan.keep == [0, 2] and plan.joiners == []
    assert plan.beam_idx is not None and plan.beam_idx.tolist() == [0, 2]
    g.ready = {4: 5, 8: 6}
    assert g.launch().beam_idx is None  # nothing left since: the identity


def _kv(rows: int, slots: int, fill: float) -> dict[str, np.ndarray]:
    a = np.full((rows, 3, slots, 2), fill, np.float32)
    return {"k": a, "v": -a}


def test_merge_left_pads_every_row_to_the_longest() -> None:
    batch = {"k": np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 2)}
    batch["v"] = -batch["k"]
    joiner = _kv(1, 6, 9.0)
    state = merged(batch, [1], [joiner])
    assert state["k"].shape == (2, 3, 6, 2)
    np.testing.assert_array_equal(state["k"][0, :, 2:], batch["k"][1])  # kept row 1, padded by 2
    np.testing.assert_array_equal(state["k"][0, :, :2], 0)
    np.testing.assert_array_equal(state["v"][1], -joiner["k"][0])  # the joiner, no padding


def test_merge_pads_a_shorter_joiner() -> None:
    state = merged(_kv(2, 5, 1.0), [0, 1], [_kv(1, 2, 7.0)])
    assert state["k"].shape == (3, 3, 5, 2)
    np.testing.assert_array_equal(state["k"][2, :, :3], 0)
    np.testing.assert_array_equal(state["k"][2, :, 3:], 7.0)


class FakeStage:
    """KV states by stream id, as a StageRunner holds them in its InferRequests."""

    def __init__(self, states: dict[int, dict[str, np.ndarray]]) -> None:
        self.states = states

    def kv(self, stream: int) -> dict[str, np.ndarray]:
        return self.states[stream]

    def set_kv(self, stream: int, kv: dict[str, np.ndarray]) -> None:
        self.states[stream] = kv

    def move(self, stream: int, to: int) -> None:
        self.states[to] = self.states.pop(stream)

    def close(self, stream: int) -> None:
        self.states.pop(stream, None)


def test_apply_merge_adopts_the_first_joiner_of_an_emptied_group() -> None:
    stage = FakeStage({-1: _kv(2, 9, 5.0), 10: _kv(1, 3, 1.0), 11: _kv(1, 4, 2.0)})
    apply_merge(stage, Launch(-1, [10, 11], [0, 0], [], [10, 11]))
    assert set(stage.states) == {-1}  # the joiners' own requests are gone, the old rows too
    k = stage.states[-1]["k"]
    assert k.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(k[0, :, 1:], 1.0)
    np.testing.assert_array_equal(k[0, :, :1], 0)
    np.testing.assert_array_equal(k[1], 2.0)


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
