"""Decode-group bookkeeping (who is a row, what a step keeps and merges) and the KV merge,
without a model."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.errors import StepRefused
from shardline.serving.groups import Group, Groups, least_loaded
from shardline.serving.stream import Stream
from shardline.stage.cache import KVBook, StepInputs
from shardline.stage.merge import apply_merge, check_merge, merged, prepare


def test_least_loaded_prefers_fewest_then_lowest_index() -> None:
    assert least_loaded([2, 1, 1]) == 1
    assert least_loaded([0, 0]) == 0
    assert least_loaded([3, 2, 5]) == 1


def test_least_loaded_skips_full_groups() -> None:
    assert least_loaded([8, 3], max_rows=8) == 1
    assert least_loaded([2, 2], max_rows=2) is None  # all full: a new group opens
    assert least_loaded([]) is None


def _stream(i: int, prompt: int, token: int, in_flight: bool = False) -> Stream:
    s = Stream(i, list(range(prompt)), SamplingParams(), max_tokens=100)
    s.book.commit(s.book.plan(s.prompt))
    s.prefilled, s.generated, s.in_flight = prompt, [token], in_flight
    return s


def test_a_group_steps_when_every_member_has_its_token() -> None:
    streams = {4: _stream(4, 3, 1), 7: _stream(7, 3, 2), 9: _stream(9, 5, 3, in_flight=True)}
    g = Group(key=-1, rows=[4, 7], held=[4, 7], joining=[9])
    assert not g.ready(streams)  # the joiner's prefill is still in flight
    streams[9].in_flight = False
    assert g.ready(streams)
    g.leave(7)
    step = g.launch(streams)
    # row 0 of the state stays, row 1 (stream 7) goes, the joiner is appended after it
    assert (step.key, step.streams, step.keep, step.merge) == (-1, (4, 9), (0,), (9,))
    assert step.inputs.beam_idx is None  # a merge rebuilds the state: no Gather needed
    assert step.sample_at.tolist() == [[0, 0], [1, 0]]
    # stream 4 (3 slots) was left-padded to the joiner's 5: both rows mask 6 slots
    assert step.inputs.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert step.inputs.position_ids.tolist() == [[3], [5]]
    assert g.rows == g.held == [4, 9] and g.joining == []
    assert not Group(key=-2).ready(streams)  # an empty group never steps


def test_leaving_without_joiners_is_a_beam_gather() -> None:
    streams = {s: _stream(s, 2, 5) for s in (4, 7, 8)}
    g = Group(key=-1, rows=[4, 7, 8], held=[4, 7, 8])
    g.leave(7)
    step = g.launch(streams)
    assert step.keep == (0, 2) and step.merge == ()
    assert step.inputs.beam_idx is not None and step.inputs.beam_idx.tolist() == [0, 2]
    step = g.launch(streams)
    assert step.keep == () and step.inputs.beam_idx is None  # nothing left since: the identity


def test_groups_open_another_when_all_are_full_and_free_an_emptied_one() -> None:
    groups = Groups(1, max_rows=2)
    assert [groups.join(s).key for s in (1, 2, 3)] == [-1, -1, -2]
    streams = {s: _stream(s, 2, 5) for s in (1, 2, 3)}
    for g in groups:
        g.launch(streams)
    assert groups.leave(1) is None  # stream 2 is still a row of group -1
    assert groups.leave(2) == -1  # its state holds only departed rows: free it
    assert groups.leave(99) is None


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
    """KV states by key, as a StageRunner holds them in its InferRequests."""

    def __init__(self, states: dict[object, dict[str, np.ndarray]]) -> None:
        self.states = states

    def has(self, key: object) -> bool:
        return key in self.states

    def rows(self, key: object) -> int:
        return int(self.states[key]["k"].shape[0])

    def kv(self, key: object) -> dict[str, np.ndarray]:
        return self.states[key]

    def set_kv(self, key: object, kv: dict[str, np.ndarray]) -> None:
        self.states[key] = kv

    def move(self, key: object, to: object) -> None:
        self.states[to] = self.states.pop(key)

    def open(self, key: object) -> None:
        self.states[key] = _kv(0, 0, 0.0)

    def close(self, key: object) -> None:
        self.states.pop(key, None)


def test_apply_merge_adopts_the_first_joiner_of_an_emptied_group() -> None:
    stage = FakeStage({-1: _kv(2, 9, 5.0), 10: _kv(1, 3, 1.0), 11: _kv(1, 4, 2.0)})
    apply_merge(stage, -1, [], [10, 11])
    assert set(stage.states) == {-1}  # the joiners' own requests are gone, the old rows too
    k = stage.states[-1]["k"]
    assert k.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(k[0, :, 1:], 1.0)
    np.testing.assert_array_equal(k[0, :, :1], 0)
    np.testing.assert_array_equal(k[1], 2.0)


@pytest.mark.parametrize(("keep", "joiners", "why"), [
    ([0], [12], "not an open one-row state"),  # unknown stream
    ([0], [-1], "not an open one-row state"),  # the group itself
    ([0], [-2], "not an open one-row state"),  # another group (two rows)
    ([2], [10], "cannot keep rows"),  # the state has rows 0 and 1 only
])
def test_a_merge_that_cannot_apply_is_refused_and_changes_nothing(keep: list[int], joiners: list[int],
                                                                  why: str) -> None:
    states = {-1: _kv(2, 9, 5.0), -2: _kv(2, 3, 1.0), 10: _kv(1, 3, 1.0)}
    stage = FakeStage(dict(states))
    assert why in (check_merge(stage, -1, keep, joiners) or "")
    with pytest.raises(StepRefused, match=why):
        prepare(stage, -1, first=False, keep=keep, merge=joiners)
    assert stage.states == states


def test_pad_left_keeps_masks_in_step_and_positions_logical() -> None:
    long, short = KVBook(), KVBook()
    long.commit(long.plan([1, 2, 3, 4, 5]))
    short.commit(short.plan([1, 2]))
    short.pad_left(long.slots - short.slots)
    rows = [long.plan([8]), short.plan([9])]
    batch = StepInputs.stack(rows, np.array([0, 1], np.int32))
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[5], [2]]  # padding moves slots, not positions
    assert batch.input_ids.tolist() == [[8], [9]]
    with pytest.raises(ValueError):
        StepInputs.stack([long.plan([1]), KVBook().plan([1])])  # masks differ in length
