"""Instance flips as pure decisions over the monitor's readings: idle time, queue pressure, which
instance flips (at most one, never the last of a role)."""

from __future__ import annotations

from shardline.disagg.flips import IdleClock, due, in_flight, pressure
from shardline.disagg.instance import FlipConfig
from shardline.disagg.state import ClusterState, DecodeLoad, PrefillLoad, Role

IDLE_P = PrefillLoad(0, 0, False)
IDLE_D = DecodeLoad(0, 0, 0, 0, 1000, 0)
CFG = FlipConfig(idle_s=1.0, pressure=2.0)


def test_in_flight_counts_what_an_instance_holds() -> None:
    assert in_flight(IDLE_P) == 0 and in_flight(IDLE_D) == 0
    assert in_flight(PrefillLoad(2, 300, True)) == 3
    assert in_flight(PrefillLoad(0, 0, True)) == 1  # a chunk still in flight
    assert in_flight(DecodeLoad(3, 1, 2, 90, 1000, 2)) == 5


def test_pressure_is_waiting_per_instance_of_a_role() -> None:
    state = ClusterState({"p0": PrefillLoad(4, 400, True), "p1": PrefillLoad(2, 100, True),
                          "d0": DecodeLoad(1, 0, 1, 10, 1000, 3), "d1": IDLE_D})
    assert pressure(state) == {Role.PREFILL: 3.0, Role.DECODE: 1.5}


def test_idle_clock_counts_from_the_first_idle_reading() -> None:
    clock = IdleClock()
    busy = ClusterState({"p0": PrefillLoad(1, 10, True), "d0": IDLE_D})
    assert clock.read(busy, 10.0) == {"p0": 0.0, "d0": 0.0}
    assert clock.read(busy, 10.5) == {"p0": 0.0, "d0": 0.5}
    idle = ClusterState({"p0": IDLE_P, "d0": IDLE_D})
    assert clock.read(idle, 11.0) == {"p0": 0.0, "d0": 1.0}
    assert clock.read(idle, 12.0) == {"p0": 1.0, "d0": 2.0}
    assert clock.read(busy, 12.5) == {"p0": 0.0, "d0": 2.5}  # work again: the clock restarts


def test_an_idle_decode_instance_flips_to_prefill_under_prefill_pressure() -> None:
    state = ClusterState({"p0": PrefillLoad(5, 900, True), "d0": IDLE_D, "d1": IDLE_D})
    assert due(state, {"d0": 1.5, "d1": 3.0}, CFG) == ("d1", Role.PREFILL)  # the longest idle
    assert due(state, {"d0": 3.0, "d1": 3.0}, CFG) == ("d0", Role.PREFILL)  # then by name
    assert due(state, {"d0": 0.5, "d1": 0.9}, CFG) is None  # not idle long enough


def test_no_flip_without_pressure_or_of_the_last_of_a_role() -> None:
    calm = ClusterState({"p0": PrefillLoad(1, 90, True), "d0": IDLE_D, "d1": IDLE_D})
    assert due(calm, {"d0": 9.0, "d1": 9.0}, CFG) is None  # pressure 1 < 2
    lone = ClusterState({"p0": PrefillLoad(5, 900, True), "d0": IDLE_D})
    assert due(lone, {"d0": 9.0}, CFG) is None  # the only decode instance stays one
    hot_decode = ClusterState({"p0": IDLE_P, "p1": IDLE_P, "d0": DecodeLoad(4, 2, 2, 500, 1000, 3)})
    assert due(hot_decode, {"p0": 2.0, "p1": 5.0}, CFG) == ("p1", Role.DECODE)


def test_an_instance_with_requests_never_flips() -> None:
    state = ClusterState({"p0": PrefillLoad(5, 900, True), "d0": DecodeLoad(1, 0, 1, 40, 1000, 0),
                          "d1": DecodeLoad(0, 0, 0, 0, 1000, 1)})
    assert due(state, {"d0": 9.0, "d1": 9.0}, CFG) is None
