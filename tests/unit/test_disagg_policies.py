"""TetriInfer's decisions as pure functions: exact choices, ties, empty inputs, bad values."""

from __future__ import annotations

import math
import random

import pytest

from shardline.disagg.instance import Admission, FlipConfig, Running, admits, flip
from shardline.disagg.policies import (
    DEFAULT_PREFILL_BATCH,
    PrefillPolicy,
    Queued,
    chunks,
    dispatch,
    has_room,
    heavy_light_ratio,
    is_heavy,
    least_loaded_prefill,
    next_batch,
)
from shardline.disagg.state import ClusterState, DecodeLoad, LengthRange, PrefillLoad, Role
from shardline.errors import ShardlineError

# -- global scheduler --------------------------------------------------------------------------


def test_least_loaded_prefill_fewest_tokens_then_requests_then_name() -> None:
    state = ClusterState({"p2": PrefillLoad(1, 500, True), "p1": PrefillLoad(4, 300, True),
                          "p0": PrefillLoad(2, 300, True), "d": DecodeLoad(0, 0, 0, 0, 10, 0)})
    assert least_loaded_prefill(state) == "p0"  # 300 tokens on p0 and p1: fewer requests
    tie = ClusterState({"pb": PrefillLoad(0, 0, False), "pa": PrefillLoad(0, 0, False)})
    assert least_loaded_prefill(tie) == "pa"


def test_least_loaded_prefill_counts_what_a_kept_prefix_saves() -> None:
    state = ClusterState({"p0": PrefillLoad(0, 0, False), "p1": PrefillLoad(1, 300, True)})
    assert least_loaded_prefill(state, {"p1": 1000}) == "p1"  # 300 queued, 1000 of this prompt saved
    assert least_loaded_prefill(state, {"p1": 299}) == "p0"  # what it saves does not pay for the queue
    assert least_loaded_prefill(state, {"p1": 300}) == "p0"  # even: fewer requests
    assert least_loaded_prefill(state, {"gone": 5000}) == least_loaded_prefill(state) == "p0"


def test_least_loaded_prefill_needs_a_prefill_instance() -> None:
    with pytest.raises(ShardlineError, match="no prefill instance in the cluster state"):
        least_loaded_prefill(ClusterState({"d": DecodeLoad(0, 0, 0, 0, 10, 0)}))
    with pytest.raises(ShardlineError, match="no prefill instance"):
        least_loaded_prefill(ClusterState({}))


# -- prefill local scheduler -------------------------------------------------------------------

QUEUE = [Queued(id=10, arrival=0, prompt_tokens=300), Queued(id=11, arrival=1, prompt_tokens=50),
         Queued(id=12, arrival=2, prompt_tokens=900), Queued(id=13, arrival=3, prompt_tokens=50)]


def ids(batch: list[Queued]) -> list[int]:
    return [q.id for q in batch]


@pytest.mark.parametrize(("policy", "order"), [
    (PrefillPolicy.FCFS, [10, 11, 12, 13]),
    (PrefillPolicy.SJF, [11, 13, 10, 12]),  # 11 and 13 tie at 50 tokens: arrival order
    (PrefillPolicy.LJF, [12, 10, 11, 13]),
])
def test_next_batch_orders_by_policy(policy: PrefillPolicy, order: list[int]) -> None:
    assert ids(next_batch(list(reversed(QUEUE)), policy)) == order


def test_next_batch_reorders_only_the_window_of_the_oldest() -> None:
    assert DEFAULT_PREFILL_BATCH == 16
    assert ids(next_batch(QUEUE, PrefillPolicy.SJF, batch_size=2)) == [11, 10]  # 13 is outside
    queue = [Queued(i, i, 1000 - i) for i in range(20)]
    assert ids(next_batch(queue, PrefillPolicy.SJF)) == list(range(15, -1, -1))


def test_next_batch_never_displaces_a_started_request() -> None:
    queue = [Queued(1, 0, 900, started=True), Queued(2, 1, 10), Queued(3, 2, 5)]
    assert ids(next_batch(queue, PrefillPolicy.SJF)) == [1, 3, 2]
    assert ids(next_batch(queue, PrefillPolicy.SJF, batch_size=1)) == [1]
    two_started = [Queued(1, 0, 900, started=True), Queued(2, 1, 800, started=True), Queued(3, 2, 5)]
    assert ids(next_batch(two_started, PrefillPolicy.SJF, batch_size=1)) == [1, 2]


def test_next_batch_empty_and_invalid() -> None:
    assert next_batch([], PrefillPolicy.LJF) == []
    with pytest.raises(ShardlineError, match="the prefill batch size must be >= 1, got 0"):
        next_batch(QUEUE, PrefillPolicy.FCFS, batch_size=0)
    with pytest.raises(ShardlineError, match="holds a request id twice"):
        next_batch([Queued(1, 0, 5), Queued(1, 1, 5)], PrefillPolicy.FCFS)
    with pytest.raises(ShardlineError, match="request 7: arrival must be >= 0 and prompt tokens >= 1"):
        Queued(7, 0, 0)


def test_chunks_fixed_size_last_padded() -> None:
    assert chunks(1100, 512) == [512, 512, 76]  # the last step: 76 tokens, 436 padded positions
    assert chunks(1024, 512) == [512, 512]
    assert chunks(1, 128) == [1]
    with pytest.raises(ShardlineError, match="chunks need prompt tokens >= 1 and a chunk >= 1, got 0 and 128"):
        chunks(0, 128)
    with pytest.raises(ShardlineError, match="got 5 and 0"):
        chunks(5, 0)


# -- dispatcher --------------------------------------------------------------------------------


def dec(heavy: int, light: int, used: int, total: int = 1000) -> DecodeLoad:
    return DecodeLoad(running=heavy + light, heavy=heavy, light=light, used=used, total=total, queued=0)


def test_heavy_light_ratio_without_light_streams() -> None:
    assert heavy_light_ratio(0, 0) == 0.0
    assert heavy_light_ratio(2, 0) == math.inf
    assert heavy_light_ratio(1, 4) == 0.25


def test_is_heavy_by_the_low_end() -> None:
    assert not is_heavy(LengthRange(0, 64), 64)
    assert is_heavy(LengthRange(64, 128), 64)
    assert is_heavy(LengthRange(192), 64)
    with pytest.raises(ShardlineError, match="the heavy-decode threshold must be >= 1 token, got 0"):
        is_heavy(LengthRange(0, 64), 0)


def test_has_room_counts_prompt_and_low_end() -> None:
    load = dec(0, 0, used=800)  # 200 free
    assert has_room(load, 100, LengthRange(100, 200))
    assert not has_room(load, 101, LengthRange(100, 200))


def test_dispatch_takes_the_lower_ratio_of_the_two() -> None:
    state = ClusterState({"a": dec(3, 1, 100), "b": dec(1, 3, 100)})
    for seed in range(20):
        assert dispatch(state, 100, LengthRange(0, 64), random.Random(seed), heavy_from=64) == "b"


def test_dispatch_counts_the_request_in_the_ratio() -> None:
    # a: 1 heavy 2 light, b: 2 heavy 4 light (both 0.5). A light request: a 1/3, b 2/5 -> a.
    state = ClusterState({"a": dec(1, 2, 0), "b": dec(2, 4, 0)})
    assert dispatch(state, 10, LengthRange(0, 64), random.Random(0), heavy_from=64) == "a"
    # A heavy request: a 2/2 = 1, b 3/4 -> b.
    assert dispatch(state, 10, LengthRange(64, 128), random.Random(0), heavy_from=64) == "b"


def test_dispatch_ties_fewer_heavy_then_used_then_name() -> None:
    heavy_req = LengthRange(128)
    # Both empty: a heavy request makes each all-heavy (infinite ratio, 0 heavy now): fewer used.
    state = ClusterState({"a": dec(0, 0, 500), "b": dec(0, 0, 100)})
    assert dispatch(state, 10, heavy_req, random.Random(0), heavy_from=64) == "b"
    same = ClusterState({"b": dec(0, 0, 0), "a": dec(0, 0, 0)})
    assert dispatch(same, 10, heavy_req, random.Random(0), heavy_from=64) == "a"
    # All heavy on both, with the heavy request: infinite each; fewer heavy streams, whatever the use.
    infinite = ClusterState({"a": dec(3, 0, 0), "b": dec(1, 0, 800)})
    assert dispatch(infinite, 10, heavy_req, random.Random(0), heavy_from=64) == "b"
    # A light request to the same two: a 3/1, b 1/1.
    assert dispatch(infinite, 10, LengthRange(0, 8), random.Random(0), heavy_from=64) == "b"
    balanced = ClusterState({"a": dec(1, 1, 0), "b": dec(2, 2, 0)})  # a light request: 1/2 and 2/3
    assert dispatch(balanced, 10, LengthRange(0, 8), random.Random(0), heavy_from=64) == "a"


def test_dispatch_only_among_instances_with_room() -> None:
    # b has the best mix but 50 free slots: the request needs 100 + 60.
    state = ClusterState({"a": dec(5, 1, 100), "b": dec(0, 0, 950), "p": PrefillLoad(0, 0, False)})
    for seed in range(20):
        assert dispatch(state, 100, LengthRange(60, 120), random.Random(seed), heavy_from=64) == "a"


def test_dispatch_with_room_nowhere_takes_the_least_used() -> None:
    state = ClusterState({"a": dec(0, 0, 950), "b": dec(0, 0, 1950, total=2000), "c": dec(0, 0, 960)})
    assert dispatch(state, 100, LengthRange(60, 120), random.Random(0), heavy_from=64) == "a"
    tie = ClusterState({"a": dec(0, 0, 950), "b": dec(0, 0, 1900, total=2000)})  # 95% each: more free
    assert dispatch(tie, 100, LengthRange(60, 120), random.Random(0), heavy_from=64) == "b"


def test_dispatch_invalid() -> None:
    with pytest.raises(ShardlineError, match="no decode instance in the cluster state"):
        dispatch(ClusterState({"p": PrefillLoad(0, 0, False)}), 10, LengthRange(0, 8), random.Random(0), 64)
    with pytest.raises(ShardlineError, match="a request to dispatch needs prompt tokens >= 1, got 0"):
        dispatch(ClusterState({"d": dec(0, 0, 0)}), 0, LengthRange(0, 8), random.Random(0), 64)


def fleet(n: int) -> ClusterState:
    """n decode instances with room, each a different mix (d0 best, the last worst)."""
    return ClusterState({f"d{i}": dec(heavy=i, light=n - i, used=10 * i) for i in range(n)})


def test_dispatch_is_deterministic_for_a_seed() -> None:
    picks = [dispatch(fleet(6), 10, LengthRange(0, 8), random.Random(s), 64) for s in range(50)]
    again = [dispatch(fleet(6), 10, LengthRange(0, 8), random.Random(s), 64) for s in range(50)]
    assert picks == again
    rng = random.Random(7)
    stream = [dispatch(fleet(6), 10, LengthRange(0, 8), rng, 64) for _ in range(50)]
    rng = random.Random(7)
    assert stream == [dispatch(fleet(6), 10, LengthRange(0, 8), rng, 64) for _ in range(50)]


@pytest.mark.parametrize("n", [3, 4, 8])
def test_power_of_two_never_picks_the_worst_and_spreads(n: int) -> None:
    rng = random.Random(1234)
    picks = [dispatch(fleet(n), 10, LengthRange(0, 8), rng, 64) for _ in range(2000)]
    assert f"d{n - 1}" not in picks
    assert set(picks) == {f"d{i}" for i in range(n - 1)}  # random, not always the best
    # The best wins every pair it is drawn in: 2/n of the draws, well above 1/n.
    assert picks.count("d0") / len(picks) == pytest.approx(2 / n, abs=0.05)


# -- decode admission --------------------------------------------------------------------------


def inst(used: int, total: int, running: list[Running]) -> DecodeLoad:
    return DecodeLoad(running=len(running), heavy=0, light=len(running), used=used, total=total, queued=0)


def test_running_remaining_from_the_low_end() -> None:
    s = Running(prompt_tokens=100, generated=30, predicted=LengthRange(50, 100))
    assert (s.held, s.remaining) == (130, 20)
    past = Running(prompt_tokens=100, generated=80, predicted=LengthRange(50, 100))
    assert past.remaining == 0  # outlived its prediction: kept, expected to end any step


def test_admission_vanilla_prompt_fits_now() -> None:
    running = [Running(100, 0, LengthRange(500, 600))]
    load = inst(used=100, total=300, running=running)  # 200 free
    assert admits(Admission.VANILLA, load, LengthRange(1000), 200, running)
    assert not admits(Admission.VANILLA, load, LengthRange(0, 8), 201, running)


def test_admission_static_counts_the_running_streams_growth() -> None:
    running = [Running(100, 10, LengthRange(50, 100))]  # holds 110, grows by 40 more
    load = inst(used=110, total=400, running=running)  # 290 free, 250 once it has grown
    assert admits(Admission.RESERVE_STATIC, load, LengthRange(50, 100), 200, running)  # needs 250
    assert not admits(Admission.RESERVE_STATIC, load, LengthRange(51, 100), 200, running)  # 251


def test_admission_dynamic_waits_for_the_shortest_remaining() -> None:
    a = Running(100, 10, LengthRange(50, 100))  # remaining 40, holds 110: frees 150 at its end
    b = Running(200, 0, LengthRange(300, 400))  # remaining 300
    load = inst(used=310, total=1000, running=[a, b])  # 690 free; 690 - 340 = 350 predicted
    request = LengthRange(250, 300)
    # Static: 200 + 250 = 450 > 350. Dynamic: 450 <= 350 + 150 = 500.
    assert not admits(Admission.RESERVE_STATIC, load, request, 200, [a, b])
    assert admits(Admission.RESERVE_DYNAMIC, load, request, 200, [a, b])
    assert admits(Admission.RESERVE_DYNAMIC, load, LengthRange(300, 400), 200, [a, b])  # 500 exactly
    assert not admits(Admission.RESERVE_DYNAMIC, load, LengthRange(301, 400), 200, [a, b])


def test_admission_dynamic_tie_frees_the_smaller_stream_and_needs_the_prompt_now() -> None:
    small = Running(10, 0, LengthRange(20, 40))
    big = Running(500, 0, LengthRange(20, 40))  # same remaining (20): the smaller one is counted
    load = inst(used=510, total=600, running=[big, small])  # 90 free, 50 predicted
    assert admits(Admission.RESERVE_DYNAMIC, load, LengthRange(0, 8), 80, [big, small])  # 80 <= 50 + 30
    assert not admits(Admission.RESERVE_DYNAMIC, load, LengthRange(0, 8), 81, [big, small])
    # Room after the shortest ends is not enough: the prompt must also fit the free slots now.
    past = Running(500, 700, LengthRange(100, 200))  # outlived its range: remaining 0, frees 1200
    full = inst(used=1200, total=1250, running=[past])
    assert not admits(Admission.RESERVE_DYNAMIC, full, LengthRange(0, 8), 60, [past])
    assert admits(Admission.RESERVE_DYNAMIC, full, LengthRange(500, 600), 50, [past])


def test_admission_reserve_policies_agree_with_nothing_running() -> None:
    load = inst(used=0, total=300, running=[])
    for policy in (Admission.RESERVE_STATIC, Admission.RESERVE_DYNAMIC):
        assert admits(policy, load, LengthRange(100, 200), 200, [])
        assert not admits(policy, load, LengthRange(101, 200), 200, [])


def test_admission_invalid() -> None:
    with pytest.raises(ShardlineError, match="a request to admit needs prompt tokens >= 1, got 0"):
        admits(Admission.VANILLA, inst(0, 10, []), LengthRange(0, 8), 0, [])
    with pytest.raises(ShardlineError, match="the instance reports 0 running streams, 1 were given"):
        admits(Admission.VANILLA, inst(0, 10, []), LengthRange(0, 8), 1, [Running(1, 0, LengthRange(0, 8))])
    with pytest.raises(ShardlineError, match="a running stream needs prompt tokens >= 1 and generated >= 0"):
        Running(1, -1, LengthRange(0, 8))


# -- instance flip -----------------------------------------------------------------------------

CFG = FlipConfig(idle_s=1.0, pressure=2.0)


def test_flip_an_idle_instance_to_the_role_under_pressure() -> None:
    pressure = {Role.PREFILL: 0.0, Role.DECODE: 3.0}
    assert flip(Role.PREFILL, 1.0, pressure, CFG, in_flight=0) is Role.DECODE
    assert flip(Role.DECODE, 5.0, {Role.PREFILL: 2.0, Role.DECODE: 0.5}, CFG, in_flight=0) is Role.PREFILL


def test_flip_stays_when_not_idle_long_or_no_pressure_or_own_role_busier() -> None:
    assert flip(Role.PREFILL, 0.99, {Role.PREFILL: 0.0, Role.DECODE: 3.0}, CFG, 0) is None
    assert flip(Role.PREFILL, 9.0, {Role.PREFILL: 0.0, Role.DECODE: 1.99}, CFG, 0) is None
    assert flip(Role.PREFILL, 9.0, {Role.PREFILL: 3.0, Role.DECODE: 3.0}, CFG, 0) is None


def test_flip_never_with_work_in_flight() -> None:
    assert flip(Role.DECODE, 60.0, {Role.PREFILL: 10.0, Role.DECODE: 0.0}, CFG, in_flight=1) is None


def test_flip_invalid() -> None:
    pressure = {Role.PREFILL: 0.0, Role.DECODE: 3.0}
    with pytest.raises(ShardlineError, match="only prefill and decode instances flip, not a coupled one"):
        flip(Role.COUPLED, 9.0, pressure, CFG, 0)
    with pytest.raises(ShardlineError, match="idle time and requests in flight must be >= 0"):
        flip(Role.PREFILL, -1.0, pressure, CFG, 0)
    with pytest.raises(ShardlineError, match="queue pressure needs a value >= 0 for prefill and decode"):
        flip(Role.PREFILL, 9.0, {Role.DECODE: 3.0}, CFG, 0)
    with pytest.raises(ShardlineError, match="queue pressure needs a value >= 0"):
        flip(Role.PREFILL, 9.0, {Role.PREFILL: -1.0, Role.DECODE: 3.0}, CFG, 0)
    with pytest.raises(ShardlineError, match="a flip needs an idle time >= 0 s and a queue pressure > 0"):
        FlipConfig(idle_s=1.0, pressure=0.0)
    with pytest.raises(ShardlineError, match="a flip needs an idle time"):
        FlipConfig(idle_s=float("nan"))
