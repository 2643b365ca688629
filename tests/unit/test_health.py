"""/health's decision, a pure function of the chains' placements and the engine's state: a stage
down, a stopped engine, and a round that left requests waiting with no step able to run."""

from __future__ import annotations

from concurrent.futures import Future

from shardline.config import SamplingParams
from shardline.pipeline.plan import Placed, Plan
from shardline.serving.kv_blocks import BlockCounts
from shardline.serving.status import health, stall
from shardline.serving.stream import Stream, new_stream_id

UP = [Placed(0, 9, "this process"), Placed(10, 19, "127.0.0.1:7001"), Placed(20, 29, "127.0.0.1:7002")]


def test_every_stage_up_is_ok_and_each_stage_is_listed() -> None:
    h = health({"": UP}, None)
    assert h.ok and h.reason == ""
    assert [(s["index"], s["where"], s["layers"], s["state"]) for s in h.stages] == [
        (0, "this process", [0, 9], "up"), (1, "127.0.0.1:7001", [10, 19], "up"), (2, "127.0.0.1:7002", [20, 29], "up")]


def test_a_stage_down_is_unhealthy_naming_it_and_why() -> None:
    down = [UP[0], UP[1], Placed(-1, -1, "127.0.0.1:7002", False, "lost worker 127.0.0.1:7002: connection reset")]
    h = health({"": down}, None)
    assert not h.ok
    assert h.reason == "stage 2 (127.0.0.1:7002) is down: lost worker 127.0.0.1:7002: connection reset"
    assert h.stages[2]["state"] == "down" and h.stages[2]["layers"] is None


def test_a_stopped_engine_is_unhealthy_first() -> None:
    h = health({"": UP}, "boom")
    assert not h.ok and h.reason == "the engine has stopped: boom"


def test_disaggregated_instances_each_count() -> None:
    bad = [UP[0], Placed(10, 29, "127.0.0.1:7003", False, "did not answer a decode step within 10.0 s")]
    h = health({"instance-0": UP, "instance-1": bad}, None)
    assert not h.ok and h.reason.startswith("instance-1 stage 1 (127.0.0.1:7003) is down: did not answer")
    assert [s["instance"] for s in h.stages] == ["instance-0"] * 3 + ["instance-1"] * 2
    assert health({"instance-0": UP}, None).ok
    assert health({}, None).ok  # every stage in this process, nothing to be down


def _waiting(prefilling: bool, in_flight: bool = False) -> Stream:
    s = Stream(new_stream_id(), [1, 2, 3], SamplingParams(), 4)
    s.prefilled = 0 if prefilling else 3
    s.generated = [] if prefilling else [5]
    s.in_flight = in_flight
    return s


def test_a_round_that_runs_nothing_while_streams_wait_is_a_stall_and_unhealthy() -> None:
    """Issue 54: two half-filled prompts holding 64 of 65 blocks, no step out: /health said "ok"
    while every request hung. A round that plans nothing while streams wait and none is in
    flight is a stall (nothing can come back to change the plan), and /health says so."""
    blocks = BlockCounts(held=64, cached=0, free=1, block_size=32)
    why = stall(Plan(), [_waiting(True), _waiting(True)], blocks)
    assert why == "no step can run: 2 streams waiting (2 prompts), none in flight; 64 of 65 KV blocks held"
    h = health({"": UP}, None, why)
    assert not h.ok and h.reason == why
    down = [UP[0], Placed(-1, -1, "127.0.0.1:7001", False, "connection reset"), UP[2]]
    assert health({"": down}, None, why).reason.startswith("stage 1 (127.0.0.1:7001) is down")  # the cause first
    assert stall(Plan(), [_waiting(False)]) == "no step can run: 1 streams waiting (0 prompts), none in flight"


def test_work_in_flight_or_planned_or_none_waiting_is_no_stall() -> None:
    assert stall(Plan(), []) is None  # idle
    assert stall(Plan(), [_waiting(True), _waiting(False, in_flight=True)]) is None  # a step comes back
    assert stall(Plan(releases=(3,)), [_waiting(True)]) is None  # the round did something
    copying = _waiting(True)
    copying.copying = Future()  # a kept prefix on its way into its lease
    assert stall(Plan(), [copying]) is None
