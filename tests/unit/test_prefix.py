"""Prefix reuse's decisions (serving/prefix.py, serving/reuse.py) as plain objects: matches within
a scope, the byte budget and least-recently-used eviction, pins, dominated entries, and what
the scheduler's plans carry (KvCopy items before the releases; a failed copy is a cold start)."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.errors import ShardlineError
from shardline.pipeline.plan import KvCopy, Lease
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import KeyedScheduler, SchedulerConfig
from shardline.serving.stream import Stream, new_stream_id

SLOT = 1000  # bytes per slot


def _cache(slots: int, min_tokens: int = 4) -> PrefixCache:
    return PrefixCache(slots * SLOT, SLOT, min_tokens)


def _kept(cache: PrefixCache, lease: int, tokens: list[int], scope: str = "") -> list[Lease]:
    entry, free = cache.keep(Lease(lease), tokens, scope)
    assert entry is not None
    return free


def test_the_longest_shared_prefix_in_the_scope_matches_leaving_the_last_prompt_token() -> None:
    cache = _cache(100)
    _kept(cache, 1, [1, 2, 3, 4, 5, 6])
    _kept(cache, 2, [1, 2, 3, 9, 9, 9, 9, 9])
    _kept(cache, 3, [1, 2, 3, 4, 5, 6, 7, 8], scope="bob")
    hit = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9], "")
    assert hit is not None and (hit[0].lease, hit[1]) == (1, 6) and hit[0].pins == 1
    whole = cache.match([1, 2, 3, 4, 5, 6], "")  # all of it kept: the last token is prefilled for its logits
    assert whole is not None and whole[1] == 5
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8], "carol") is None  # never across scopes
    assert cache.match([1, 2, 7, 7, 7], "") is None  # 2 shared: under min_tokens
    assert (cache.stats.hits, cache.stats.misses, cache.stats.tokens_saved) == (2, 2, 11)


def test_entries_stay_within_the_budget_least_recently_used_going_first_pinned_never() -> None:
    cache = _cache(20)
    _kept(cache, 1, list(range(100, 108)))  # 8 slots
    _kept(cache, 2, list(range(200, 208)))  # 16
    hit = cache.match([*range(100, 108), 5], "")  # 1 is used (and pinned) after 2
    assert hit is not None
    assert _kept(cache, 3, list(range(300, 306))) == [Lease(2)]  # 2 is the least recently used
    assert cache.held == 14 * SLOT
    # 1 is pinned: a 14-slot entry does not fit beside it, and nothing is evicted for it
    assert cache.keep(Lease(4), list(range(400, 414)), "") == (None, [Lease(4)])
    assert cache.held == 14 * SLOT
    assert _kept(cache, 5, list(range(500, 510))) == [Lease(3)]  # 8 + 10 fits once 3 goes
    cache.unpin(hit[0])
    assert _kept(cache, 6, list(range(600, 614))) == [Lease(1), Lease(5)]
    assert cache.held <= cache.budget and cache.stats.evicted == 4


def test_a_flood_of_distinct_prompts_never_holds_more_than_the_budget() -> None:
    rng = np.random.default_rng(7)
    cache, held = _cache(500, 16), 0
    for lease in range(400):
        tokens = rng.integers(0, 50_000, int(rng.integers(16, 120))).tolist()
        cache.keep(Lease(lease), tokens, str(lease % 3))
        held = max(held, cache.held)
    assert held <= 500 * SLOT and len(cache.entries) >= 4


def test_an_entry_that_a_newer_one_extends_is_dropped_and_too_short_or_large_is_not_kept() -> None:
    cache = _cache(100)
    _kept(cache, 1, [1, 2, 3, 4, 5])
    _kept(cache, 2, [1, 2, 3, 4, 5], scope="bob")
    assert _kept(cache, 3, [1, 2, 3, 4, 5, 6, 7]) == [Lease(1)]  # its own scope's alone
    assert cache.keep(Lease(4), [1, 2, 3], "") == (None, [Lease(4)])
    assert cache.keep(Lease(5), list(range(101)), "") == (None, [Lease(5)])
    assert [e.lease for e in cache.entries] == [2, 3]
    assert cache.clear() == [Lease(2), Lease(3)] and cache.held == 0


def _stream(prompt: list[int], scope: str | None = "", prompt_kept: bool = True) -> Stream:
    """A stream; by default one whose prompt is not offered at prefill's end (keep_prompt's own test)."""
    return Stream(new_stream_id(), prompt, SamplingParams(), 8, prefix_scope=scope, prompt_kept=prompt_kept)


def _scheduler(cache: PrefixCache) -> KeyedScheduler:
    return KeyedScheduler(SchedulerConfig(chunk=64, groups=0, pacing=None), prefix=cache)


def _ended(sched: KeyedScheduler, prompt: list[int], generated: list[int], scope: str | None = "") -> Stream:
    """A stream run to its end by hand: its prompt in one chunk, then a decode step per token."""
    s = _stream(prompt, scope)
    s.key = sched.kv.lease()
    s.book = sched.kv.book(s.key)
    sched.add(s)
    sched.plan()
    s.in_flight = False
    for token in generated:
        s.generated.append(token)
        if len(s.generated) < len(generated):
            sched.plan()
            s.in_flight = False
    return s


def test_an_ended_stream_is_kept_by_a_copy_before_its_release_and_a_later_prompt_starts_from_it() -> None:
    cache = _cache(1000)
    sched = _scheduler(cache)
    first = _ended(sched, list(range(10, 30)), [7, 8, 9])
    sched.remove(first, keep=True)
    plan = sched.plan()
    (keep,) = plan.copies
    assert (keep.src, keep.row, keep.index.tolist()) == (first.key, 0, list(range(22)))  # 9 was never fed
    assert plan.releases == (first.key,) and keep.dst not in plan.releases
    (entry,) = cache.entries
    assert entry.tokens.tolist() == [*range(10, 30), 7, 8] and entry.lease == keep.dst
    _land(sched, keep)

    second = _stream([*range(10, 30), 7, 8, 50, 51])
    second.key = sched.kv.lease()
    sched.add(second)
    assert second.prefilled == 0 and cache.stats.hits == 0  # looked up as its prefill is next
    plan = sched.plan()
    assert second.prefilled == 22 and second.book.position == 22 and second.copying is not None
    (copy,) = plan.copies
    assert (copy.src, copy.dst, copy.index.tolist()) == (entry.lease, second.key, list(range(22)))
    assert plan.steps == () and entry.pins == 1  # no step before the copy is in
    _land(sched, copy)
    (step,) = sched.plan().steps
    assert step.inputs.input_ids.tolist() == [[50, 51]] and not step.first  # type: ignore[attr-defined]
    assert step.inputs.position_ids.tolist() == [[22, 23]] and entry.pins == 0


def test_a_copy_that_failed_is_a_cold_start_and_an_opted_out_stream_neither_reuses_nor_is_kept() -> None:
    cache = _cache(1000)
    sched = _scheduler(cache)
    sched.remove(_ended(sched, list(range(10, 30)), [7, 8, 9]), keep=True)
    _land(sched, sched.plan().copies[0], ShardlineError("stage 1: no such key"))
    sched.plan()
    assert cache.entries == []  # its own copy failed: forgotten
    sched.remove(_ended(sched, list(range(10, 30)), [7, 8, 9]), keep=True)
    _land(sched, sched.plan().copies[0])
    again = _stream([*range(10, 30), 7, 8, 50])
    again.key = sched.kv.lease()
    sched.add(again)
    _land(sched, sched.plan().copies[0], ShardlineError("stage 0: unknown key"))
    (step,) = sched.plan().steps
    assert step.inputs.input_ids.shape == (1, 23) and step.first  # type: ignore[attr-defined]
    assert again.prefilled == 23 and cache.stats.tokens_saved == 0

    out = _stream([*range(10, 30), 7, 8, 60], scope=None)
    out.key = sched.kv.lease()
    sched.add(out)
    assert out.prefilled == 0 and out.copying is None
    before = cache.stats.kept
    sched.plan()
    out.in_flight = False
    out.generated = [1]
    sched.remove(out, keep=True)
    assert sched.plan().copies == () and cache.stats.kept == before


@pytest.mark.parametrize("scope", ["", "alice"])
def test_a_stream_in_a_decode_group_is_kept_from_its_row(scope: str) -> None:
    cache = _cache(1000)
    sched = KeyedScheduler(SchedulerConfig(chunk=64, groups=1, pacing=None), prefix=cache)
    a, b = _stream(list(range(10, 30)), scope), _stream(list(range(40, 70)), scope)
    for s in (a, b):
        s.key = sched.kv.lease()
        s.book = sched.kv.book(s.key)
        sched.add(s)
    sched.plan()
    for s, t in ((a, 1), (b, 2)):
        s.in_flight = False
        s.generated.append(t)
    (step,) = sched.plan().steps  # the two join one group: rows a, b, left-padded to 30 slots
    for s, t in ((a, 3), (b, 4)):
        s.in_flight = False
        s.generated.append(t)
    sched.remove(a, keep=True)
    (copy,) = sched.plan().copies
    assert (copy.src, copy.row) == (step.key, 0)
    assert copy.index.tolist() == list(range(10, 31))  # past its 10 slots of left padding: prompt, then 1
    assert cache.entries[0].tokens.tolist() == [*range(10, 30), 1] and cache.entries[0].scope == scope


def test_a_prompt_is_kept_once_in_so_that_one_arriving_meanwhile_starts_from_it() -> None:
    cache = _cache(1000)
    sched = _scheduler(cache)
    system = list(range(100, 140))
    a = _stream([*system, 1, 2, 3], prompt_kept=False)
    a.key = sched.kv.lease()
    a.book = sched.kv.book(a.key)
    sched.add(a)
    sched.plan()
    a.in_flight = False
    a.generated.append(9)
    plan = sched.plan()
    (copy,) = plan.copies  # before a's first decode step, in the same plan
    assert (copy.src, copy.index.tolist()) == (a.key, list(range(43))) and len(plan.steps) == 1
    assert a.prompt_kept and cache.entries[0].tokens.tolist() == [*system, 1, 2, 3]
    _land(sched, copy)
    b = _stream([*system, 4, 5], prompt_kept=False)  # a is still decoding
    b.key = sched.kv.lease()
    sched.add(b)
    _land(sched, sched.plan().copies[0])
    assert b.prefilled == 40 and cache.stats.hits == 1
    sched.plan()
    b.in_flight = False
    b.generated.append(8)
    assert sched.plan().copies == ()  # the entry holds all of b's prompt but its last 2: not kept again


def _added(sched: KeyedScheduler, prompt: list[int], scope: str | None = "") -> Stream:
    s = _stream(prompt, scope, prompt_kept=False)
    s.key = sched.kv.lease()
    s.book = sched.kv.book(s.key)
    sched.add(s)
    return s


def test_prompts_arriving_together_with_one_system_prompt_wait_for_the_first_then_start_from_it() -> None:
    """Prompts sharing most of themselves with an earlier one still prefilling wait for its prompt
    to be kept, then copy it and prefill only their own tokens; a prompt sharing little (a chat
    template's header), one opted out, or one of another scope never waits."""
    cache = _cache(1000)
    sched = KeyedScheduler(SchedulerConfig(chunk=64, groups=0, pacing=None, max_prefills=6), prefix=cache)
    system = list(range(100, 200))
    a = _added(sched, [*system, 1, 2, 3])
    b, c = _added(sched, [*system, 4, 5, 6]), _added(sched, [*system, 7])
    header = _added(sched, [*system[:20], *range(500, 540)])  # shares 20 of its 60
    alone = _added(sched, [*system, 8, 9], scope=None)
    other = _added(sched, [*system, 8, 9], scope="bob")
    first = sched.plan()
    assert [s.streams for s in first.steps] == [(a.id,), (header.id,), (alone.id,), (other.id,)]
    assert first.copies == () and (cache.stats.hits, cache.stats.misses) == (0, 3)  # `alone` looks for none
    for s in (a, header, alone, other):
        s.in_flight = False
    assert [s.streams for s in sched.plan().steps] == [(a.id,), (alone.id,), (other.id,)]  # a's rest: b, c wait
    a.in_flight = False
    a.generated.append(9)
    plan = sched.plan()
    keep, into_b, into_c = plan.copies  # a's prompt kept, then copied into b and c, in that order
    assert (keep.src, into_b.src, into_c.src) == (a.key, keep.dst, keep.dst)
    assert (into_b.dst, into_b.index.tolist(), into_c.index.tolist()) == (b.key, list(range(100)), list(range(100)))
    assert cache.stats.hits == 2 and not any(b.id in s.streams or c.id in s.streams for s in plan.steps)
    for x in plan.copies:
        _land(sched, x)
    steps = {s.streams[0]: s for s in sched.plan().steps}
    assert steps[b.id].inputs.input_ids.tolist() == [[4, 5, 6]]  # type: ignore[attr-defined]
    assert steps[c.id].inputs.input_ids.tolist() == [[7]]  # type: ignore[attr-defined]


def test_a_stream_waiting_for_an_earlier_prompt_starts_cold_when_that_one_ends_first() -> None:
    cache = _cache(1000)
    sched = KeyedScheduler(SchedulerConfig(chunk=64, groups=0, pacing=None), prefix=cache)
    system = list(range(100, 200))
    a, b = _added(sched, [*system, 1]), _added(sched, [*system, 2])
    assert [s.streams for s in sched.plan().steps] == [(a.id,)]
    a.in_flight = False
    sched.remove(a)  # cancelled mid-prompt: nothing kept
    (step,) = sched.plan().steps
    assert step.streams == (b.id,) and step.first and step.inputs.input_ids.shape == (1, 64)  # type: ignore[attr-defined]
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)


def _land(sched: KeyedScheduler, copy: KvCopy, error: Exception | None = None) -> None:
    """What the engine does when a copy's Moved comes out of the pipeline: it takes it in."""
    if error is None:
        copy.done.set_result(None)
    else:
        copy.done.set_exception(error)
    sched.moved(copy)
