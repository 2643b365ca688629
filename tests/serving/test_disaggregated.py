"""Disaggregated serving in one process (issue 13): prefill instances hand each prefilled stream's
KV to a decode instance, behind one front end. Exact precision: every request's tokens equal a
coupled engine's, greedy and seeded sampling alike; cancels anywhere on the way end their
request alone; a decode instance without room holds an arrival until a stream ends; a request
no decode instance takes fails alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.disagg.decode import DecodeRole, decode_instance
from shardline.disagg.front import Disaggregated, FrontConfig
from shardline.disagg.instance import Admission, FlipConfig
from shardline.disagg.policies import PrefillPolicy
from shardline.disagg.prefill import Moving, PrefillRole, oracle_predict, prefill_instance
from shardline.disagg.state import Role
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import KvExport, KvMove, Pipeline
from shardline.server import process_slot_bytes
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request, Serving
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS

EXACT = RunConfig(precision="exact", threads=1)
CONTEXT = 4096
WAIT_S = 120.0
PREDICT = oracle_predict(64, 8)
# (prompt, max tokens, temperature, seed): greedy and sampled, one ending at its first token
CASES = [(0, 12, 0.0, None), (1, 30, 0.8, 7), (2, 1, 0.0, None), (3, 20, 0.0, None), (4, 25, 1.0, 3)]


@pytest.fixture(scope="module")
def prompts(two: Path) -> list[list[int]]:
    tok = ChatTokenizer(two)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def stop_ids(two: Path) -> frozenset[int]:
    return frozenset(ChatTokenizer(two).stop_ids)


@pytest.fixture(scope="module")
def pipes(two: Path) -> Iterator[list[LocalPipeline]]:
    made = [LocalPipeline(two, EXACT) for _ in range(3)]
    yield made
    for p in made:
        p.shutdown()


def _requests(prompts: list[list[int]], stop_ids: frozenset[int]) -> list[Request]:
    return [Request(prompts[i], SamplingConfig(max_tokens=n, temperature=t, seed=seed), stop_ids)
            for i, n, t, seed in CASES]


class Collect:
    """Every event of each request; `wait` until each has its final one."""

    def __init__(self, n: int) -> None:
        self.events: list[list[Event]] = [[] for _ in range(n)]
        self._done = threading.Semaphore(0)

    def on(self, i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            self.events[i].append(ev)
            if ev.finish:
                self._done.release()
        return event

    def wait(self) -> list[tuple[list[int], str]]:
        for _ in self.events:
            assert self._done.acquire(timeout=WAIT_S)
        for evs in self.events:
            assert [e.finish is not None for e in evs].count(True) == 1 and evs[-1].finish, evs
        return [([e.token for e in evs if e.token is not None], evs[-1].finish or "") for evs in self.events]


def _run(serving: Serving, requests: list[Request]) -> list[tuple[list[int], str]]:
    got = Collect(len(requests))
    for i, r in enumerate(requests):
        serving.submit(r, got.on(i))
    return got.wait()


def _front(pipes: list[Pipeline], decodes: int, admission: Admission = Admission.RESERVE_DYNAMIC,
           decode_streams: int = 8, policy: PrefillPolicy = PrefillPolicy.FCFS, chunked: bool = False) -> Disaggregated:
    front = Disaggregated(FrontConfig(heavy_from=64, period_s=0.02))
    prefill = prefill_instance(pipes[0], Limits(8, 16), CONTEXT, 16, front.dispatch, PREDICT, policy,
                               chunked_kv=chunked)
    decode = {f"decode-{i}": decode_instance(pipes[1 + i], Limits(decode_streams, 16), CONTEXT,
                                             SchedulerConfig(chunk=16, groups=1), admission,
                                             decode_streams * CONTEXT, 64) for i in range(decodes)}
    front.start({"prefill-0": prefill}, decode)
    return front


@pytest.fixture(scope="module")
def coupled(pipes: list[LocalPipeline], prompts: list[list[int]],
            stop_ids: frozenset[int]) -> list[tuple[list[int], str]]:
    engine = Engine(pipes[0], Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1))
    try:
        return _run(engine, _requests(prompts, stop_ids))
    finally:
        engine.stop()


@pytest.mark.parametrize("decodes, chunked", [(1, False), (2, False), (1, True)])
def test_tokens_equal_a_coupled_engine(pipes: list[LocalPipeline], prompts: list[list[int]],
                                       stop_ids: frozenset[int], coupled: list[tuple[list[int], str]],
                                       decodes: int, chunked: bool) -> None:
    """Request-level KV transfer to one or two decode instances, and chunk-level to one."""
    assert [f for _, f in coupled] != ["length"] * len(CASES) or all(t for t, _ in coupled)
    front = _front(list(pipes), decodes, chunked=chunked)
    try:
        got = _run(front, _requests(prompts, stop_ids))
        assert got == coupled
        assert front.active == 0 and front.waiting == 0 and front.failed is None
        used = [front.decodes[n].load() for n in front.decodes]
        assert all(x.running == 0 and x.queued == 0 for x in used)
    finally:
        front.stop()


def test_a_moved_stream_keeps_its_id_and_takes_a_lease_of_the_decode_instance(
        pipes: list[LocalPipeline], prompts: list[list[int]], stop_ids: frozenset[int],
        coupled: list[tuple[list[int], str]]) -> None:
    """Identity apart from state: the decode instance imports a stream's KV on a lease of its
    own (its first streams get 0, 1, ...) and the stream keeps the id it had when prefilled."""
    front = _front(list(pipes), 1)
    decode, seen = front.decodes["decode-0"], list[tuple[Any, int]]()
    adopt = decode.adopt

    def recording(moving: Any) -> None:
        seen.append((moving, moving.stream.id))
        adopt(moving)

    decode.adopt = recording  # type: ignore[method-assign]
    try:
        assert _run(front, _requests(prompts, stop_ids)) == coupled
    finally:
        front.stop()
    moved = [(m, sid) for m, sid in seen if m.stream.generated]
    assert moved and all(m.stream.id == sid for m, sid in moved)
    assert sorted(m.stream.key for m, _ in moved) == list(range(len(moved)))
    assert len({m.stream.id for m, _ in moved}) == len(moved)


class Exports:
    """A pipeline that records every KV export asked of it (key, start), and runs it."""

    def __init__(self, pipe: LocalPipeline) -> None:
        self.pipe, self.asked = pipe, list[tuple[int, int]]()

    def move(self, item: KvMove) -> None:
        if isinstance(item, KvExport):
            self.asked.append((item.lease, item.start))
        self.pipe.move(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)


def test_chunk_level_transfer_exports_each_chunk_once_it_has_run(pipes: list[LocalPipeline],
                                                                  prompts: list[list[int]],
                                                                  stop_ids: frozenset[int],
                                                                  coupled: list[tuple[list[int], str]]) -> None:
    """Chunks of 16: each prompt's slots go out 16 at a time, the last chunk's as it leaves;
    a request done at its first token leaves nothing to move (its slices were exported and
    dropped); every request gets its coupled tokens."""
    spy = Exports(pipes[0])
    front = _front([cast(Pipeline, spy), *pipes[1:]], 1, chunked=True)
    try:
        assert _run(front, _requests(prompts, stop_ids)) == coupled
    finally:
        front.stop()
    by_key: dict[int, list[int]] = {}
    for key, start in spy.asked:
        by_key.setdefault(key, []).append(start)
    chunks = sorted(-(-len(prompts[i]) // 16) - (n == 1) for i, n, *_ in CASES)  # max_tokens 1: no last slice
    assert sorted(len(starts) for starts in by_key.values()) == chunks
    assert all(starts == list(range(0, 16 * len(starts), 16)) for starts in by_key.values())


def test_cancels_on_the_way_end_their_request_alone(pipes: list[LocalPipeline], prompts: list[list[int]],
                                                    stop_ids: frozenset[int],
                                                    coupled: list[tuple[list[int], str]]) -> None:
    """Request 0 is cancelled at once (waiting or prefilling), request 1 at its 3rd token (on a
    decode instance); request 3 runs to its end with the tokens it has alone."""
    front = _front(pipes, 1)
    got = Collect(4)
    tickets = {}

    def third(ev: Event) -> None:
        got.on(1)(ev)
        if len([e for e in got.events[1] if e.token is not None]) == 3:
            front.cancel(tickets[1])
    try:
        reqs = [Request(prompts[i], SamplingConfig(max_tokens=200), frozenset()) for i in (0, 1, 2)]
        tickets[0] = front.submit(reqs[0], got.on(0))
        front.cancel(tickets[0])
        tickets[1] = front.submit(reqs[1], third)
        tickets[2] = front.submit(reqs[2], got.on(2))
        front.cancel(tickets[2])
        front.submit(_requests(prompts, stop_ids)[3], got.on(3))
        out = got.wait()
        assert out[0][1] == "cancelled"
        assert out[1][1] == "cancelled" and 3 <= len(out[1][0]) < 200
        assert out[2][1] == "cancelled"
        assert out[3] == coupled[3]
        assert _settles(lambda: front.active == 0) and front.failed is None
    finally:
        front.stop()


def _settles(check: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Whether `check` holds within `within_s` (engines drop a finished stream on their thread)."""
    pause = threading.Event()
    for _ in range(int(within_s / 0.05)):
        if check():
            return True
        pause.wait(0.05)
    return check()


def test_a_full_decode_instance_holds_arrivals_until_a_stream_ends(
        pipes: list[LocalPipeline], prompts: list[list[int]], stop_ids: frozenset[int],
        coupled: list[tuple[list[int], str]]) -> None:
    """One stream slot on the only decode instance: requests queue there in turn, none is lost,
    and each gets the tokens it has alone (its KV waited in host memory)."""
    front = _front(pipes, 1, Admission.VANILLA, decode_streams=1)
    try:
        assert _run(front, _requests(prompts, stop_ids)) == coupled
    finally:
        front.stop()


def test_reserve_static_admits_only_what_its_predictions_fit(pipes: list[LocalPipeline],
                                                             prompts: list[list[int]]) -> None:
    """A decode instance of 200 KV slots under reserve-static: a request predicted to need
    fewer than 200 runs; while it runs, one whose prompt plus predicted decode (64..) would not
    fit beside it waits, then runs once the first ends. Both complete."""
    front = Disaggregated(FrontConfig(heavy_from=64, period_s=0.02))
    prefill = prefill_instance(pipes[0], Limits(8, 16), CONTEXT, 16, front.dispatch, PREDICT)
    decode = decode_instance(pipes[1], Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1),
                             Admission.RESERVE_STATIC, 200, 64)
    front.start({"p": prefill}, {"d": decode})
    short = len(prompts[0])
    assert short + 64 < 200 < 2 * (short + 64)
    seen: list[int] = []

    def watch(ev: Event) -> None:
        seen.append(decode.load().running)
    try:
        got = Collect(2)
        for i in range(2):
            front.submit(Request(prompts[0], SamplingConfig(max_tokens=70), frozenset()),
                         lambda ev, i=i: (watch(ev), got.on(i)(ev)))
        out = got.wait()
        assert [f for _, f in out] == ["length", "length"] and out[0][0] == out[1][0]
        assert max(seen) == 1  # never both at once
    finally:
        front.stop()


def test_a_request_no_decode_instance_takes_fails_alone(pipes: list[LocalPipeline],
                                                        prompts: list[list[int]]) -> None:
    def refuse(m: Moving) -> None:
        raise RuntimeError("no room anywhere")

    engine = prefill_instance(pipes[0], Limits(4, 4), CONTEXT, 16, refuse, PREDICT).engine
    try:
        got = Collect(2)
        engine.submit(Request(prompts[0], SamplingConfig(max_tokens=5), frozenset()), got.on(0))
        engine.submit(Request(prompts[1], SamplingConfig(max_tokens=1), frozenset()), got.on(1))
        out = got.wait()
        assert out[0][1] == "error" and len(out[0][0]) == 1  # its first token came from the prefill
        assert "no decode instance took the request: no room anywhere" in got.events[0][-1].error
        assert out[1][1] == "length" and len(out[1][0]) == 1  # done at its first token: never sent
        assert engine.failed is None and engine.active == 0
    finally:
        engine.stop()


def test_sjf_and_ljf_order_a_queued_batch(pipes: list[LocalPipeline], prompts: list[list[int]]) -> None:
    """One stream slot on a prefill instance: while a long prompt prefills, three more queue
    (middle, short, long); they form the next batch and get their first tokens shortest first
    under SJF, longest first under LJF (each ends at its first token: max_tokens 1)."""
    middle, short, long = prompts[1] + prompts[0], prompts[0], prompts[2] + prompts[1] + prompts[0]
    queued = [middle, short, long]
    blocker = [t for p in prompts for t in p] * 2
    for policy, want in ((PrefillPolicy.SJF, [1, 0, 2]), (PrefillPolicy.LJF, [2, 0, 1])):
        engine = prefill_instance(pipes[0], Limits(1, 8), CONTEXT, 16, lambda m: None, PREDICT, policy).engine
        order: list[int] = []
        got = Collect(4)

        def on(n: int, order: list[int] = order, got: Collect = got) -> Callable[[Event], None]:
            def event(ev: Event) -> None:
                if ev.token is not None:
                    order.append(n)
                got.on(n + 1)(ev)
            return event
        try:
            engine.submit(Request(blocker, SamplingConfig(max_tokens=1), frozenset()), got.on(0))
            for n, p in enumerate(queued):
                engine.submit(Request(p, SamplingConfig(max_tokens=1), frozenset()), on(n))
            assert all(f == "length" for _, f in got.wait())
            assert order == want
        finally:
            engine.stop()


def test_an_idle_decode_instance_flips_to_prefill_and_no_request_is_lost(
        pipes: list[LocalPipeline], prompts: list[list[int]]) -> None:
    """1 prefill + 2 decode instances with flips on: a burst of long prompts queues on the prefill
    instance while both decode instances are idle, so one of them becomes a second prefill
    instance. Every request completes with the tokens a coupled engine gives it."""
    burst = [Request(prompts[i % 5] * 3, SamplingConfig(max_tokens=6), frozenset()) for i in range(8)]
    engine = Engine(pipes[0], Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1))
    try:
        alone = _run(engine, burst)
    finally:
        engine.stop()
    front = Disaggregated(FrontConfig(heavy_from=64, period_s=0.02, flip=FlipConfig(idle_s=0.05, pressure=1.0)))

    def prefill_on(pipe: Pipeline) -> PrefillRole:  # each keeps the prompts it prefills (the burst repeats 5)
        return prefill_instance(pipe, Limits(8, 16), CONTEXT, 16, front.dispatch, PREDICT,
                                prefix=PrefixCache(64 << 20, _slot_bytes(pipe)))

    def decode_on(pipe: Pipeline) -> DecodeRole:
        return decode_instance(pipe, Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1), Admission.VANILLA,
                               8 * CONTEXT, 64)

    front.start({"i0": prefill_on(pipes[0])}, {"i1": decode_on(pipes[1]), "i2": decode_on(pipes[2])},
                lambda role, pipe: prefill_on(pipe) if role is Role.PREFILL else decode_on(pipe))
    try:
        assert _run(front, burst) == alone
        assert [(f.old, f.new) for f in front.flips][:1] == [(Role.DECODE, Role.PREFILL)]
        assert len(front.prefills) + len(front.decodes) == 3 and front.decodes and front.failed is None
        assert front.prefix_stats()[0].kept >= 1
    finally:
        front.stop()
        for r in front.prefills.values():
            r.engine.drop_prefixes()


def _until(ready: Callable[[], bool]) -> None:
    """Wait for `ready` (the cluster monitor's next readings), bounded."""
    deadline = time.monotonic() + WAIT_S
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


def _held(pipe: LocalPipeline) -> list[set[int]]:
    """The keys each stage holds, once the releases submitted so far have run (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            held = [set(stage.keys()) for stage in pipe.stages]
        except RuntimeError:  # a stage thread changed its keys while they were read
            continue
        if not any(held) or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


def test_prefill_instances_keep_prompts_and_a_chat_s_next_turn_prefills_only_the_rest_where_it_is_kept(
        pipes: list[LocalPipeline], prompts: list[list[int]]) -> None:
    """Two prefill instances with prefix caches, one decode instance. An unrelated request goes to
    the first prefill instance, the chat's first turn to the second (the first is busy); the next
    turn, sent when both are idle, goes to the second, which keeps the first turn's prompt, and
    prefills only what is new. Every token equals a coupled engine's without a cache; once the
    instances drop their entries, their stages hold nothing."""
    system = prompts[0] * 3
    other = Request(prompts[1] * 3, SamplingConfig(max_tokens=6), frozenset())
    turn1 = Request(system, SamplingConfig(max_tokens=8), frozenset())
    engine = Engine(pipes[0], Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1))
    try:
        cold = _run(engine, [other, turn1])
        turn2 = Request(system + cold[1][0] + prompts[2], SamplingConfig(max_tokens=8), frozenset())
        cold += _run(engine, [turn2])
    finally:
        engine.stop()
    front = Disaggregated(FrontConfig(heavy_from=64, period_s=0.02))
    prefills = {f"p{i}": prefill_instance(pipes[i], Limits(8, 16), CONTEXT, 16, front.dispatch, PREDICT,
                                          prefix=PrefixCache(64 << 20, _slot_bytes(pipes[i]))) for i in range(2)}
    decode = decode_instance(pipes[2], Limits(8, 16), CONTEXT, SchedulerConfig(chunk=16, groups=1),
                             Admission.VANILLA, 8 * CONTEXT, 64)
    front.start(prefills, {"d": decode})
    try:
        assert _run(front, [other, turn1]) == cold[:2]
        assert [r.engine.prefix_stats()[0].kept for r in prefills.values()] == [1, 1]
        _until(lambda: all(load.queued == 0 for load in front.state.prefill().values()))  # read idle
        assert _run(front, [turn2]) == cold[2:]
        stats, held = front.prefix_stats()
        assert (prefills["p1"].engine.prefix_stats()[0].hits, stats.hits) == (1, 1)
        assert stats.tokens_saved == len(system) and held > 0
        with pytest.raises(ShardlineError, match="kept prefixes are dropped only once the engine has stopped"):
            prefills["p0"].engine.drop_prefixes()
    finally:
        front.stop()
        for r in prefills.values():
            r.engine.drop_prefixes()
    assert _held(pipes[0]) == _held(pipes[1]) == [set()] * len(pipes[0].stages)


def _slot_bytes(pipe: Pipeline) -> int:
    return process_slot_bytes(pipe.layout(), pipe.placement())
