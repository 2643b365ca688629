"""KV moves as plan items: the prefill role's handoff policy in the scheduler, the KvTable's
moves, and the order `execute` hands a plan's items to a pipeline (plain objects, no stages)."""

from __future__ import annotations

from typing import Any

from shardline.config import SamplingParams
from shardline.disagg.prefill import PrefillOnly
from shardline.pipeline.plan import KvExport, KvImport, KvMove, Plan, PrefillStep, Step, execute
from shardline.serving.kv_table import KvTable
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.stream import Stream
from shardline.stage.cache import KVBook


def _prefill_scheduler(chunked: bool) -> tuple[KeyedScheduler, Stream]:
    sched = KeyedScheduler(SchedulerConfig(chunk=4, groups=0, max_prefills=1, pacing=None), PrefillOnly(chunked))
    s = Stream(5, list(range(100, 110)), SamplingParams(), 8, key=sched.kv.lease())
    sched.add(s)
    return sched, s


def _complete(sched: KeyedScheduler, step: Step) -> None:
    for r, sid in enumerate(step.streams):
        stream = sched.streams[sid]
        stream.in_flight = False
        stream.generated += [7] * step.entries(r)


def _rounds(sched: KeyedScheduler, n: int) -> list[Plan]:
    plans = []
    for _ in range(n):
        plans.append(sched.plan())
        for step in plans[-1].steps:
            _complete(sched, step)
    return plans


def test_a_prefilled_stream_leaves_with_its_whole_kv_exported_before_its_lease_is_released() -> None:
    sched, s = _prefill_scheduler(chunked=False)
    plans = _rounds(sched, 4)
    assert [len(p.steps) for p in plans] == [1, 1, 1, 0]  # three chunks of 4, 4, 2 tokens
    assert all(not p.exports and not p.releases for p in plans[:3])
    last = plans[3]
    assert [(x.lease, x.start) for x in last.exports] == [(0, 0)] and last.releases == (0,)
    assert sched.take_left() == [s] and sched.take_left() == [] and 5 not in sched.streams
    assert s.handover.kv_sent == [last.exports[0].done] and s.handover.kv_through == 10
    assert sched.plan() == Plan()  # nothing more: the stream left


def test_chunk_level_transfer_exports_each_chunk_before_the_next_one_runs() -> None:
    sched, s = _prefill_scheduler(chunked=True)
    plans = _rounds(sched, 4)
    assert [[(x.lease, x.start) for x in p.exports] for p in plans] == [[], [(0, 0)], [(0, 4)], [(0, 8)]]
    assert [p.releases for p in plans] == [(), (), (), (0,)]
    assert [type(p.steps[0]).__name__ for p in plans[:3]] == ["PrefillStep"] * 3
    assert [p.steps[0].inputs.position_ids.tolist() for p in plans[1:3]] == [[[4, 5, 6, 7]], [[8, 9]]]
    assert len(s.handover.kv_sent) == 3 and sched.take_left() == [s]


def test_a_leaving_stream_s_prompt_is_kept_before_its_lease_is_released() -> None:
    """With a prefix cache, a prefill instance keeps each leaving prompt's KV (a copy within the
    stages, before the release); the next prompt sharing it starts from a copy of that entry
    and prefills only the rest, and leaves with its whole KV exported."""
    sched = KeyedScheduler(SchedulerConfig(chunk=8, groups=0, max_prefills=1, pacing=None), PrefillOnly(),
                      PrefixCache(1 << 20, 1, min_tokens=4))
    system = list(range(100, 110))
    first = Stream(1, system + [7, 8], SamplingParams(), 8, key=sched.kv.lease(), prefix_scope="")
    sched.add(first)
    plans = _rounds(sched, 3)
    kept = plans[2]
    assert [(c.src, c.index.tolist()) for c in kept.copies] == [(0, list(range(12)))]
    assert kept.releases == (0,) and [x.lease for x in kept.exports] == [0]
    for c in kept.copies:
        c.done.set_result(None)
        sched.moved(c)  # what the engine does with its Moved
    second = Stream(2, system + [9, 9, 9], SamplingParams(), 8, key=sched.kv.lease(), prefix_scope="")
    sched.add(second)
    start = sched.plan()  # the copy of the entry's first 10 slots, then the rest once it is in
    (copy,) = start.copies
    assert (copy.src, copy.dst, copy.index.tolist(), start.steps) == (kept.copies[0].dst, 2, list(range(10)), ())
    copy.done.set_result(None)
    sched.moved(copy)
    rest = _rounds(sched, 2)
    assert rest[0].steps[0].inputs.position_ids.tolist() == [[10, 11, 12]]
    assert [(x.lease, x.start) for x in rest[1].exports] == [(2, 0)] and sched.take_left() == [first, second]
    assert sched.reuse is not None and sched.reuse.cache.stats.tokens_saved == 10


def test_a_stream_ending_at_its_first_token_does_not_leave() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=16, groups=0, max_prefills=1, pacing=None), PrefillOnly())
    s = Stream(1, [3, 4, 5], SamplingParams(), 1, key=sched.kv.lease())
    sched.add(s)
    (plan, after) = _rounds(sched, 2)
    assert isinstance(plan.steps[0], PrefillStep) and s.done
    assert after == Plan() and sched.take_left() == []  # the engine ends it here


def test_a_coupled_scheduler_moves_no_kv() -> None:
    sched = KeyedScheduler(SchedulerConfig(chunk=4, groups=0, pacing=None))
    sched.add(Stream(1, list(range(10)), SamplingParams(), 3))
    plans = _rounds(sched, 6)
    assert all(not p.exports and not p.imports for p in plans) and sched.take_left() == []


def test_a_kv_table_imports_on_a_fresh_lease_and_hands_each_move_over_once() -> None:
    table = KvTable()
    first = table.lease()
    snap: Any = object()
    lease, done = table.import_(snap, KVBook())
    exported = table.export(first, 3)
    assert lease == 1 and not done.done() and not exported.done()
    exports, imports = table.take_moves()
    assert [(x.lease, x.start, x.done) for x in exports] == [(first, 3, exported)]
    assert [(y.lease, y.snap, y.done) for y in imports] == [(1, snap, done)]
    assert table.take_moves() == ((), ())


class _Pipe:
    """Records what it is handed, in order; holds exports, refuses one import, lands the others."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def move(self, item: KvMove) -> None:
        self.calls.append((type(item).__name__, item.lease))
        if isinstance(item, KvImport):
            if item.snap == "refused":
                raise RuntimeError("no such layout")
            item.done.set_result(None)

    def release(self, key: int) -> None:
        self.calls.append(("release", key))

    def submit(self, step: Step) -> None:
        self.calls.append(("submit", step.key))


def test_execute_hands_exports_then_releases_then_imports_then_steps() -> None:
    sched, _ = _prefill_scheduler(chunked=False)
    (step,) = sched.plan().steps
    out, bad, ok = KvExport(4), KvImport(8, "refused"), KvImport(9, "fine")  # type: ignore[arg-type]
    pipe = _Pipe()
    execute(pipe, Plan((4, 6), (step,), (out,), (bad, ok)), lambda s, why: None)  # type: ignore[arg-type]
    assert pipe.calls == [("KvExport", 4), ("release", 4), ("release", 6), ("KvImport", 8), ("KvImport", 9),
                          ("submit", 0)]
    assert str(bad.done.exception()) == "no such layout" and ok.done.result() is None
    assert not out.done.done() and not out.done.cancel()  # under way: no one can cancel it


def test_a_kv_table_owns_each_leases_book_until_it_is_freed() -> None:
    table, imported = KvTable(), KVBook()
    imported.commit(imported.plan([5] * 7))  # a cache of 7 slots, as a handoff brings it
    a = table.lease()
    b, _ = table.import_(object(), imported)  # type: ignore[arg-type]
    assert table.book(b) is imported and table.book(a).slots == 0 and table.slots() == 7
    table.free(b)
    assert b not in table.books and table.slots() == 0 and table.take_freed() == [b]


def test_a_replay_takes_the_book_of_its_new_lease() -> None:
    sched, s = _prefill_scheduler(chunked=False)
    for step in sched.plan().steps:
        _complete(sched, step)
    old = s.book
    new = sched.kv.lease()
    sched.replay(s, new)
    assert s.book is sched.kv.book(new) and s.book is not old and s.book.slots == 0
    assert 0 not in sched.kv.books  # the old lease's book went with it
