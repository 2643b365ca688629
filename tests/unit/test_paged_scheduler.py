"""The paged scheduler's decisions, as plain objects (issue 41): one ragged step a round with
decode tokens first and prompt chunks in the budget, blocks taken as tokens are planned, oldest
stream first (a prompt waits for what older prompts still need; a stream short of blocks
preempts the youngest idle stream younger than itself: issue 54), prefixes shared by block only
once the steps that wrote them came back. tests/unit/test_paged_progress.py: that it never
stalls, as a property."""

from __future__ import annotations

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.pipeline.ragged_step import RaggedStep
from shardline.serving.kv_blocks import BlockCounts, BlockPool, BlockTable
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.stream import Stream, new_stream_id


def _stream(prompt: list[int], max_tokens: int = 50, scope: str | None = None) -> Stream:
    return Stream(new_stream_id(), prompt, SamplingParams(), max_tokens, prefix_scope=scope)


def _sched(blocks: int = 64, chunk: int = 8, prefix: bool = False, in_flight: int = 1) -> PagedScheduler:
    return PagedScheduler(SchedulerConfig(chunk=chunk, pacing=None), BlockPool(blocks, 4), prefix=prefix,
                          in_flight=in_flight)


def _step(sched: PagedScheduler) -> RaggedStep | None:
    steps = sched.plan().steps
    assert len(steps) <= 1
    if not steps:
        return None
    assert isinstance(steps[0], RaggedStep)
    return steps[0]


def _complete(sched: PagedScheduler, step: RaggedStep, token: int = 7) -> None:
    """What the engine does with the outcomes: each sampled sequence gets a token."""
    sampled = set(step.sample_at[:, 0].tolist())
    for q, sid in enumerate(step.streams):
        s = sched.streams[sid]
        s.in_flight = False
        if q in sampled:
            s.generated.append(token)


def _run(sched: PagedScheduler, rounds: int) -> list[RaggedStep]:
    out = []
    for _ in range(rounds):
        step = _step(sched)
        if step is None:
            break
        _complete(sched, step)
        out.append(step)
    return out


def test_decode_tokens_go_first_and_prompts_fill_the_budget() -> None:
    sched = _sched(chunk=8)
    a, b = _stream(list(range(10, 15))), _stream(list(range(20, 25)))
    sched.add(a)
    sched.add(b)
    _run(sched, 1)  # both prompts (5 + 5 tokens): the first whole, the second's first 3 (budget 8)
    assert (a.prefilled, b.prefilled, a.generated, b.generated) == (5, 3, [7], [])
    c = _stream(list(range(100, 130)))
    sched.add(c)
    step = _step(sched)
    assert step is not None
    # a's decode token first, then b's last 2 prompt tokens, then 6 of c's 30 (2 + 6 = the budget of 8)
    assert step.streams == (a.id, b.id, c.id)
    assert step.batch.begins.tolist() == [0, 1, 3, 9]
    assert step.batch.past_lens.tolist() == [5, 3, 0]
    assert step.sample_at.tolist() == [[0, 0], [1, 1]]  # a's next token, and b's first (its prompt is in)
    assert step.ids.tolist() == [7, 23, 24, *range(100, 106)]
    assert step.prompt_tokens == 8
    assert _step(sched) is None  # every stream has a step in flight


def test_one_step_in_flight_so_that_a_new_prompt_rides_with_the_decode_tokens() -> None:
    sched = _sched(chunk=8)
    a = _stream(list(range(10, 15)))
    sched.add(a)
    first = _step(sched)
    assert first is not None
    b = _stream(list(range(20, 25)))
    sched.add(b)
    assert _step(sched) is None  # b's prompt waits for a's step, rather than running alone beside it
    _complete(sched, first)
    step = _step(sched)
    assert step is not None and step.streams == (a.id, b.id)


def test_a_stream_holds_the_blocks_of_its_tokens_not_its_worst_case() -> None:
    sched = _sched(blocks=64, chunk=64)
    s = _stream(list(range(10, 20)), max_tokens=1000)
    sched.add(s)
    _run(sched, 3)  # the prompt, then 2 decode steps: 12 tokens' KV planned
    assert s.blocks is not None and len(s.blocks.blocks) == 3 and sched.pool.held == 3
    sched.remove(s)
    assert sched.pool.held == 0 and sched.pool.available == 64


def test_a_prompt_waits_for_blocks() -> None:
    sched = _sched(blocks=4, chunk=64)  # 16 tokens in all
    a, b = _stream(list(range(10, 22))), _stream(list(range(30, 40)))  # 12 tokens (3 blocks), 10 (3 blocks)
    sched.add(a)
    sched.add(b)
    step = _step(sched)
    assert step is not None and step.streams == (a.id,)  # b's 3 blocks are not there: it waits
    _complete(sched, step)
    sched.remove(a)
    step = _step(sched)
    assert step is not None and step.streams == (b.id,)


def test_a_decode_token_preempts_the_youngest_idle_stream() -> None:
    sched = _sched(blocks=4, chunk=64)
    a, b = _stream(list(range(10, 18))), _stream(list(range(30, 37)))  # 8 tokens (2 blocks), 7 (2 blocks)
    sched.add(a)
    sched.add(b)
    _run(sched, 1)
    assert sched.pool.held == 4
    step = _step(sched)  # a's decode token needs a third block: b (younger, idle) gives its blocks back
    assert step is not None and step.streams == (a.id,) and sched.preempted == 1
    assert b.blocks is None and b.prefilled == 0 and b.resumed == 1  # b prefills its prompt and its token again
    _complete(sched, step)
    sched.remove(a)
    step = _step(sched)
    assert step is not None and step.streams == (b.id,) and step.ids.tolist() == [*range(30, 37), 7]


def test_only_younger_streams_are_preempted_a_prompt_s_too() -> None:
    """A stream short of blocks takes them from younger idle streams only, a prompt's chunk too:
    the oldest stream is never preempted, so no two streams take each other's blocks in turn
    (issue 54). Here an older long prompt takes the blocks of a younger short one that went
    ahead and decodes; before, that one's decode token took the older prompt's instead."""
    sched = PagedScheduler(SchedulerConfig(chunk=4, short_chunk=8, pacing=None), BlockPool(6, 4))
    a, b = _stream(list(range(100, 120)), max_tokens=2), _stream([5, 6, 7], max_tokens=12)  # 5 blocks; 1 + 3
    sched.add(a)
    sched.add(b)
    _run(sched, 4)
    assert (a.prefilled, len(b.generated), sched.pool.held) == (16, 4, 6)  # b went ahead, the pool is full
    step = _step(sched)
    assert step is not None and step.streams == (a.id,)  # a's last chunk: b (younger, idle) gave its blocks
    assert (sched.preempted, a.replays, b.replays, b.blocks) == (1, 0, 1, None)


def test_two_long_prompts_on_a_pool_of_fewer_than_two_do_not_split_it() -> None:
    """Issue 54's stall, scaled down: a pool of 9 blocks of 4 where one stream at the context of
    32 needs 8, two prompts of 30 tokens fed 4 tokens a chunk, two chunks a step. They took the
    pool a chunk at a time until neither could finish; now the younger waits for the older's
    rest, then takes its place, and nothing is preempted."""
    sched = PagedScheduler(SchedulerConfig(chunk=4, short_chunk=8, pacing=None), BlockPool(9, 4))
    a, b = _stream(list(range(100, 130)), max_tokens=2), _stream(list(range(200, 230)), max_tokens=2)
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        step = _step(sched)
        if step is None:
            break
        assert not (b.id in step.streams and a.prefilling)  # b starts only once a's prompt is all planned
        _complete(sched, step)
        for s in (a, b):
            if s.done and s.id in sched.streams:
                sched.remove(s)
    assert (a.generated, b.generated, sched.preempted, sched.pool.held) == ([7, 7], [7, 7], 0, 0)


def test_a_prefix_is_shared_by_block_once_written() -> None:
    sched = _sched(blocks=64, chunk=64, prefix=True, in_flight=2)
    system = list(range(200, 213))  # 13 tokens: 3 full blocks of 4
    a = _stream([*system, 1, 2], scope="k")
    sched.add(a)
    step = _step(sched)
    assert step is not None
    early = _stream([*system, 3, 4], scope="k")
    sched.add(early)
    assert _step(sched) is not None and sched.stats.tokens_saved == 0  # a's blocks are being written: nothing shared
    _complete(sched, step)
    late, other = _stream([*system, 5, 6], scope="k"), _stream([*system, 5, 6], scope="another key")
    sched.add(late)
    sched.add(other)
    _step(sched)  # a's step came back: its 3 full blocks are found (by the stream in its scope only)
    assert a.blocks is not None and late.blocks is not None
    assert late.blocks.blocks[:3] == a.blocks.blocks[:3] and sched.stats.tokens_saved == 12
    assert other.blocks is not None and not set(other.blocks.blocks) & set(a.blocks.blocks)
    before = sched.pool.counts()
    # a front's reading (issue 56: the engine asks any scheduler): a's written blocks, nothing taken
    assert sched.covers([*system, 7, 8], "k") == 12 and sched.covers([*system, 7, 8], "a third key") == 0
    assert sched.pool.counts() == before and _sched(prefix=False).covers([*system, 7, 8], "k") == 0


def test_drafts_ride_after_the_token_and_rejected_ones_give_their_blocks_back() -> None:
    sched = _sched(blocks=64, chunk=64)
    s = _stream(list(range(10, 17)))  # 7 tokens: 2 blocks of 4
    sched.add(s)
    _run(sched, 1)
    step = sched.plan({s.id: Proposal([40, 41, 42, 43, 44])}).steps[0]
    assert isinstance(step, RaggedStep)
    assert step.ids.tolist() == [7, 40, 41, 42, 43, 44] and step.batch.past_lens.tolist() == [7]
    assert step.sample_at.tolist() == [[0, t] for t in range(6)]  # after every position: a verify step
    assert step.batch.logits_at.tolist() == list(range(6))
    assert s.blocks is not None and len(s.blocks.blocks) == 4  # 13 tokens
    s.in_flight = False
    s.generated += [40, 9]  # the first draft stood, the second did not: the target's own token instead
    assert _step(sched) is not None  # planned from what the stream holds: 7 + 3 tokens, the rest let go
    assert len(s.blocks.blocks) == 3 and sched.pool.held == 3 and s.blocks.written == 9


def test_steps_in_flight_share_the_decoding_streams() -> None:
    """Over workers one step per stage is out: a round sends as many as may go, the decoding
    streams shared among them, each stream in one at a time."""
    sched = _sched(chunk=64, in_flight=3)
    streams = [_stream(list(range(10 * i + 10, 10 * i + 15))) for i in range(4)]
    for s in streams:
        sched.add(s)
    for step in sched.plan().steps:  # the prompts, two a step (max_prefills)
        assert isinstance(step, RaggedStep)
        _complete(sched, step)
    steps = sched.plan().steps
    assert [s.streams for s in steps if isinstance(s, RaggedStep)] == [
        (streams[0].id, streams[1].id), (streams[2].id,), (streams[3].id,)]
    assert sched.plan().steps == ()  # three out: none more
    second = steps[1]
    assert isinstance(second, RaggedStep)
    _complete(sched, second)
    again = sched.plan().steps
    assert [s.streams for s in again if isinstance(s, RaggedStep)] == [(streams[2].id,)]


def test_a_lost_stream_forgets_every_kept_prefix() -> None:
    """The pipeline lost a step (a chain broke): the blocks its workers held are gone, so a
    replay, and every later prompt, starts cold."""
    sched = _sched(chunk=64, prefix=True)
    system = list(range(200, 213))
    a = _stream([*system, 1, 2], max_tokens=1, scope="k")
    sched.add(a)
    _run(sched, 1)
    sched.remove(a, keep=True)
    assert sched.pool.cached == 3
    b = _stream([*system, 3, 4], scope="k")
    sched.add(b)
    sched.replay(b, sched.kv.lease())
    assert sched.pool.cached == 0
    _run(sched, 1)
    assert sched.stats.tokens_saved == 0 and b.prefilled == len(b.prompt)


def test_a_stream_that_leaves_has_its_blocks_read_out_and_one_that_arrives_takes_blocks() -> None:
    """Disaggregated serving on paged pipelines: a prefilled stream's blocks are exported (before
    any later step may take them) and go back; on the other side it takes blocks for its tokens,
    the snapshot is imported into them, and it decodes from there."""
    from shardline.disagg.prefill import PrefillOnly
    from shardline.pipeline.kv import KvSnapshot

    here = _sched(chunk=64)
    here.handoffs = PrefillOnly()
    s = _stream(list(range(10, 19)))  # 9 tokens: 3 blocks of 4
    here.add(s)
    _run(here, 1)  # the whole prompt, and its first token
    plan = here.plan()
    (out,) = plan.exports
    assert (out.blocks, out.tokens, plan.steps) == ((0, 1, 2), 9, ())
    assert here.take_left() == [s] and s.handover.kv_sent == [out.done] and here.pool.held == 0
    kv = KvSnapshot("export", 1, 9, ())
    there = _sched(blocks=8)
    there.pool.grow(BlockTable(), 4)  # another stream holds block 0 there: ids need not match
    landed = there.arrive(s, there.handoff(s, kv))
    (into,) = there.plan().imports
    assert into.snap is kv and into.blocks == (1, 2, 3) and into.done is landed and s.blocks is not None
    landed.set_result(None)
    there.add(s)
    step = _step(there)
    assert step is not None and step.streams == (s.id,) and step.batch.past_lens.tolist() == [9]
    assert step.ids.tolist() == [7]  # its first token, sampled on the prefill instance, fed here
    full = _sched(blocks=2)
    assert not full.room(9)
    failed = full.arrive(_stream([1, 2]), full.handoff(s, kv))
    assert "no free KV blocks for 9 tokens" in str(failed.exception())


def test_chunk_level_transfer_reads_each_chunks_full_blocks_out_as_it_goes() -> None:
    """Issue 56: `--kv-transfer chunk` on a paged pipeline. After each prompt chunk the full
    blocks written since the last export go out (each slice starting at a block), and the
    leaving stream's export is the rest alone: slices that join into its whole prompt."""
    from shardline.disagg.prefill import PrefillOnly

    here = _sched(chunk=6)
    here.handoffs = PrefillOnly(chunked_kv=True)
    s = _stream(list(range(10, 25)))  # 15 tokens: chunks of 6, 6, 3; blocks of 4
    here.add(s)
    slices = []
    for _ in range(4):  # each round: the last chunk's blocks out, then the next chunk
        plan = here.plan()
        slices += [(e.start, e.blocks, e.tokens) for e in plan.exports]
        for step in plan.steps:
            assert isinstance(step, RaggedStep) and step.streams == (s.id,)
            _complete(here, step)
    assert slices == [(0, (0,), 4), (4, (1, 2), 8), (12, (3,), 3)]  # 6 tokens: 1 full block; 12: 3; then the rest
    assert here.take_left() == [s] and len(s.handover.kv_sent) == 3 and here.pool.held == 0


def test_a_hit_whose_blocks_were_lost_is_a_miss() -> None:
    """A prompt started from kept blocks, then the chain broke under it (a worker restarted:
    those blocks are gone): it prefills them again, so its hit saved nothing. Each stream
    counts once, however often it starts over; evicted kept blocks are counted."""
    sched = _sched(blocks=8, chunk=64, prefix=True)
    system = list(range(200, 213))  # 3 full blocks of 4
    a = _stream([*system, 1, 2], max_tokens=1, scope="k")
    sched.add(a)
    _run(sched, 1)
    sched.remove(a, keep=True)
    b = _stream([*system, 3, 4], scope="k")
    sched.add(b)
    step = _step(sched)
    assert step is not None and b.prefilled == 15 and step.batch.past_lens.tolist() == [12]
    s = sched.prefix_stats()
    assert (s.hits, s.misses, s.tokens_saved, s.evicted) == (1, 1, 12, 0)
    b.in_flight = False  # its step was lost
    sched.replay(b, sched.kv.lease())
    _run(sched, 1)  # every token of its prompt again, and no lookup counted twice
    s = sched.prefix_stats()
    assert (s.hits, s.misses, s.tokens_saved) == (0, 2, 0) and b.prefilled == 15
    sched.remove(b, keep=True)
    assert sched.pool.counts() == BlockCounts(held=0, cached=3, free=5, block_size=4)
    c = _stream(list(range(300, 329)), max_tokens=1, scope="k")  # 8 blocks: b's 3 cached ones evicted
    sched.add(c)
    _run(sched, 1)
    assert sched.prefix_stats().evicted == 3 and sched.pool.counts() == BlockCounts(8, 0, 0, 4)
