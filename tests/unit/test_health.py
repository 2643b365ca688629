"""/health's decision, a pure function of the chains' placements and the engine's state."""

from __future__ import annotations

from shardline.pipeline.plan import Placed
from shardline.serving.status import health

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
