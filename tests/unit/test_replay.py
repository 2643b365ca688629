"""A stream the pipeline lost starts again: the policy that bounds it, the stream record's reset,
and what the scheduler plans next (a fresh key, its prompt and tokens so far prefilled again)."""

from __future__ import annotations

import pytest

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.errors import ShardlineError
from shardline.pipeline.plan import PrefillStep
from shardline.serving.drafters import LookupDrafter
from shardline.serving.replay import Replays, refusal
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.speculation import Speculation
from shardline.serving.stream import Stream

WHY = "lost worker 127.0.0.1:7001: 127.0.0.1:7001 closed the connection"


def test_a_lost_stream_is_replayed_a_few_times_within_a_bounded_time() -> None:
    policy = Replays(most=2, within_s=10.0)
    assert refusal(policy, 0, 0.0, WHY) is None
    assert refusal(policy, 1, 9.9, WHY) is None
    assert refusal(policy, 1, 10.5, WHY) == f"the pipeline broke and could not be repaired within 10 s: {WHY}"
    assert refusal(policy, 2, 0.0, WHY) == f"the pipeline broke under this request 3 times; not replayed again: {WHY}"
    with pytest.raises(ShardlineError, match="replays need a count >= 0 and a time > 0 s"):
        Replays(1, 0.0)


def _decoding(i: int, generated: list[int]) -> Stream:
    """Stream i, its 5-token prompt prefilled, `generated` chosen (the last not yet fed)."""
    s = Stream(i, [100, 101, 102, 103, 104], SamplingParams(seed=5), 50)
    s.book.commit(s.book.plan(s.prompt + generated[:-1]))
    s.prefilled, s.generated = len(s.prompt), list(generated)
    return s


def test_a_restart_forgets_the_kv_and_drafts_and_keeps_every_token() -> None:
    s = _decoding(3, [7, 8, 9])
    s.spec = Speculation(LookupDrafter(), None, 8)
    s.spec.offer(Proposal([10, 11]))
    s.spec.settle([10, 3], now=1.0)
    s.spec.offer(Proposal([10, 11]))
    s.in_flight = True
    with pytest.raises(ValueError, match="stream 3 still has a step in flight"):
        s.restart(12)
    s.in_flight = False
    s.restart(12)
    # the stream keeps its identity and takes a new lease
    assert (s.id, s.key, s.prefilled, s.book.slots, s.book.position, s.replays) == (3, 12, 0, 0, 0, 1)
    assert s.prefix() == [100, 101, 102, 103, 104, 7, 8, 9] and s.generated == [7, 8, 9]
    assert s.prefilling and not s.decoding
    assert s.spec.proposal == Proposal([]) and not s.spec.planned
    assert s.spec._last is None  # the outage is not timed as a step of its pace


def test_replayed_group_members_prefill_again_on_new_leases_in_their_places() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=6, groups=1))
    for s in (_decoding(1, [7, 8]), _decoding(2, [9])):
        sched.add(s)
    (launch,) = sched.plan().steps  # a group forms: both streams are its rows
    for s in sched.streams.values():
        s.in_flight = False  # the step came back lost
    sched.replay(sched.streams[1], 10)
    assert sched.releases() == [1]  # the group keeps its other member: its key stays
    sched.replay(sched.streams[2], 11)
    assert sched.releases() == [2, launch.key]  # the last member left: the group's KV goes too
    assert list(sched.streams) == [1, 2] and [s.key for s in sched.streams.values()] == [10, 11]
    steps = sched.plan().steps
    assert all(isinstance(p, PrefillStep) and p.first for p in steps)
    assert [(p.key, p.streams, p.inputs.input_ids[0].tolist(), p.sample_at.tolist()) for p in steps] == [
        (10, (1,), [100, 101, 102, 103, 104, 7], []), (11, (2,), [100, 101, 102, 103, 104, 9], [[0, 5]])]
    first = sched.streams[1]
    first.in_flight = False
    (rest,) = sched.plan().steps  # stream 2's prefill is in flight; stream 1 continues its prefix
    assert isinstance(rest, PrefillStep) and not rest.first
    # the token after 8 is sampled at 8's position, as the decode step feeding 8 would have
    assert rest.inputs.input_ids.tolist() == [[8]] and rest.inputs.position_ids.tolist() == [[6]]
    assert rest.sample_at.tolist() == [[0, 0]] and not first.prefilling
