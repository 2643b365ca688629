"""The scheduler's decisions, as plain objects: chunks, interleaving, groups, releases."""

from __future__ import annotations

import pytest

from shardline.config import SamplingParams
from shardline.errors import ShardlineError
from shardline.pipeline.plan import DecodeStep, PrefillStep, Step, execute
from shardline.serving.kv_table import KvTable, group_lease
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.stream import Stream


def _stream(i: int, prompt: int, max_tokens: int = 50) -> Stream:
    return Stream(i, list(range(100, 100 + prompt)), SamplingParams(), max_tokens)


def _complete(sched: KeyedScheduler, step: Step, token: int = 7) -> None:
    """What the engine does with a step's outcomes: each asked position gives a token."""
    for r, s in enumerate(step.streams):
        stream = sched.streams[s]
        stream.in_flight = False
        stream.generated += [token] * step.entries(r)


def test_a_long_prompt_goes_in_chunks_one_at_a_time() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=4, groups=0))
    sched.add(_stream(1, 10))
    seen = []
    while True:
        steps = sched.plan().steps
        if not steps:
            break
        assert sched.plan().steps == ()  # nothing more while the chunk is in flight
        (step,) = steps
        if isinstance(step, DecodeStep):
            break
        assert isinstance(step, PrefillStep)
        seen.append((step.first, step.inputs.input_ids[0].tolist(), step.sample_at.tolist()))
        _complete(sched, step)
    assert seen == [(True, [100, 101, 102, 103], []), (False, [104, 105, 106, 107], []),
                    (False, [108, 109], [[0, 1]])]
    assert step.inputs.position_ids.tolist() == [[10]] and step.inputs.attention_mask.shape == (1, 11)


def test_prefill_chunks_interleave_with_a_running_group() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=8, groups=1))
    sched.add(_stream(1, 3))
    (p,) = sched.plan().steps
    _complete(sched, p)
    sched.add(_stream(2, 40))  # a long prompt arrives while stream 1 decodes
    kinds = []
    for _ in range(5):
        steps = sched.plan().steps
        kinds.append(sorted(type(s).__name__ for s in steps))
        for s in steps:
            _complete(sched, s)
    # every round runs one decode step of the group beside one chunk of the new prompt
    assert kinds == [["DecodeStep", "PrefillStep"]] * 5
    assert sched.streams[1].generated == [7] * 6


def test_at_most_max_prefills_prompts_at_once_oldest_first() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=2, groups=1, max_prefills=2))
    for i in (1, 2, 3):
        sched.add(_stream(i, 6))
    assert [s.streams for s in sched.plan().steps] == [(1,), (2,)]


def test_without_groups_every_stream_decodes_on_its_own_key() -> None:
    sched = KeyedScheduler(SchedulerConfig(groups=0))
    for i in (1, 2):
        sched.add(_stream(i, 3))
    for s in sched.plan().steps:
        _complete(sched, s)
    steps = sched.plan().steps
    assert [(s.key, s.streams) for s in steps] == [(1, (1,)), (2, (2,))]
    assert all(isinstance(s, DecodeStep) and not s.merge for s in steps)


def test_a_new_stream_joins_the_group_at_its_next_step() -> None:
    sched = KeyedScheduler(SchedulerConfig(groups=1))
    sched.add(_stream(1, 3))
    for s in sched.plan().steps:
        _complete(sched, s)
    (first,) = sched.plan().steps  # stream 1's first decode: it becomes the group's first row
    assert isinstance(first, DecodeStep) and (first.key, first.keep, first.merge) == (-1, (), (1,))
    sched.add(_stream(2, 5))
    (chunk,) = sched.plan().steps  # the group waits for stream 1's token; stream 2 prefills
    assert chunk.streams == (2,)
    _complete(sched, first)
    _complete(sched, chunk)
    (step,) = sched.plan().steps
    assert isinstance(step, DecodeStep) and (step.keep, step.merge, step.streams) == ((0,), (2,), (1, 2))


def test_ending_streams_release_their_keys_and_an_emptied_group() -> None:
    sched = KeyedScheduler(SchedulerConfig(groups=1))
    a, b, c = _stream(1, 3), _stream(2, 3), _stream(3, 3)
    sched.add(a)
    sched.add(b)
    for _ in range(2):  # prefills, then one group step with both as rows
        for s in sched.plan().steps:
            _complete(sched, s)
    sched.add(c)
    steps = sched.plan().steps  # the group's next step, and c's prompt
    with pytest.raises(ShardlineError, match="in flight"):
        sched.remove(c)
    for s in steps:
        _complete(sched, s)
    sched.remove(c)
    sched.remove(a)
    assert sched.releases() == [3, 1]  # their own keys (no-ops on stages where they moved)
    sched.remove(b)
    assert sched.releases() == [2, -1]  # the group's state holds only departed rows
    assert sched.releases() == []


class _Recorder:
    """A pipeline that records what it is handed, in order; one key's submit raises."""

    def __init__(self, refuse: int) -> None:
        self.calls: list[tuple[str, int]] = []
        self.refuse = refuse

    def release(self, key: int) -> None:
        self.calls.append(("release", key))

    def submit(self, step: Step) -> None:
        if step.key == self.refuse:
            raise RuntimeError("cannot start")
        self.calls.append(("submit", step.key))


def test_a_plan_releases_the_keys_of_ended_streams_before_its_steps() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=8, groups=0))
    a, b, c = _stream(1, 3), _stream(2, 3), _stream(3, 3)
    for s in (a, b):
        sched.add(s)
    for step in sched.plan().steps:  # both prompts; then a ends
        _complete(sched, step)
    sched.remove(a)
    sched.add(c)
    plan = sched.plan()
    assert plan.releases == (1,)
    assert [s.key for s in plan.steps] == [2, 3]  # b decodes, c prefills
    assert sched.plan().releases == ()  # handed over once

    pipe, failed = _Recorder(refuse=3), []
    execute(pipe, plan, lambda step, why: failed.append((step.key, why)))  # type: ignore[arg-type]
    assert pipe.calls == [("release", 1), ("submit", 2)]
    assert failed == [(3, "RuntimeError: cannot start")]


def test_a_kv_table_issues_fresh_leases_and_hands_freed_ones_over_once() -> None:
    table = KvTable()
    leases = [table.lease() for _ in range(3)]
    assert leases == [0, 1, 2] and all(group_lease(g) < 0 for g in range(4))
    assert len({group_lease(g) for g in range(4)}) == 4
    table.free(leases[1])
    table.free(group_lease(0))
    assert table.take_freed() == [1, -1] and table.take_freed() == []


def test_a_replayed_stream_keeps_its_id_and_frees_its_old_lease() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=8, groups=0))
    s = _stream(7, 3)
    s.key = sched.kv.lease()
    sched.add(s)
    for step in sched.plan().steps:
        _complete(sched, step)
    new = sched.kv.lease()
    sched.replay(s, new)
    plan = sched.plan()
    assert plan.releases == (0,) and list(sched.streams) == [7]
    (step,) = plan.steps
    assert (step.key, step.streams) == (new, (7,)) and isinstance(step, PrefillStep) and step.first
