"""The paged scheduler never stalls and never livelocks (issue 54), as a property over the pure
scheduler: random pools (at least one stream at the context, as pipeline/paged_local.pool_blocks
guarantees), prompt lengths, answers, `max_prefills`, steps in flight, arrival orders, prefix
sharing and speculation's drafts. Steps come back without processes, in any order; every round
with nothing in flight plans a step while streams wait, the oldest stream is never preempted (no
two streams take each other's blocks in turn), and every stream finishes. Each block's reference
count is the number of tables holding it, always."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.pipeline.ragged_step import RaggedStep
from shardline.serving.kv_blocks import BlockPool, blocks_for
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.stream import Stream, new_stream_id

TOKEN = 7  # what every sampled position chooses


@dataclass(frozen=True)
class Case:
    block_size: int
    context: int
    extra_blocks: int  # beyond one stream at the context
    chunk: int
    short_chunk: int
    max_prefills: int
    in_flight: int
    prefix: bool
    requests: tuple[tuple[int, int, int, int], ...]  # (arrival round, prompt length, answer length, prompt seed)
    seed: int  # the order steps come back in, the drafts offered and how many stand


@st.composite
def cases(draw: st.DrawFn) -> Case:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    context = draw(st.integers(8, 96))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, context - 1))
        requests.append((draw(st.integers(0, 12)), prompt, draw(st.integers(1, context - prompt)),
                         draw(st.integers(0, 3))))
    chunk = draw(st.integers(1, 64))
    return Case(block_size, context, draw(st.integers(0, 2 * blocks_for(context, block_size))), chunk,
                draw(st.integers(chunk, 96)), draw(st.integers(1, 8)), draw(st.integers(1, 3)), draw(st.booleans()),
                tuple(requests), draw(st.integers(0, 2**32)))


def _prompt(length: int, seed: int) -> list[int]:
    """Prompts of a few kinds that share prefixes (a prefix hit needs equal leading blocks)."""
    return [100 + (i * (seed + 1)) % 5 for i in range(length)]


def _drafts(sched: PagedScheduler, rng: random.Random) -> dict[int, Proposal]:
    """Drafts for some idle decoding streams, within what they may still generate (the engine's rule)."""
    out = {}
    for s in sched.streams.values():
        room = s.max_tokens - len(s.generated) - 1
        if s.idle_decoder() and room > 0 and rng.random() < 0.5:
            out[s.id] = Proposal([TOKEN] * rng.randint(1, min(room, 4)))
    return out


def _back(sched: PagedScheduler, step: RaggedStep, drafts: dict[int, Proposal], rng: random.Random) -> None:
    """What the engine does with a step's outcomes: each sampled stream gets its token (after the
    drafts that stood), and one that has all it asked for ends, its blocks kept for reuse."""
    rows = step.sample_at[:, 0].tolist()
    for q, sid in enumerate(step.streams):
        s = sched.streams[sid]
        s.in_flight = False
        if positions := rows.count(q):  # a decode token and its drafts (every position), or a prompt's last chunk
            offered = list(drafts[sid].tokens[: positions - 1]) if positions > 1 else []
            stood = offered[: rng.randint(0, len(offered))]
            s.generated += [*stood, TOKEN][: s.max_tokens - len(s.generated)]
        if s.done:
            sched.remove(s, keep=True)


def _check_refs(sched: PagedScheduler) -> None:
    holders = [0] * sched.pool.size
    for s in sched.streams.values():
        for b in s.blocks.blocks if s.blocks is not None else []:
            holders[b] += 1
    assert holders == sched.pool.ref
    counts = sched.pool.counts()
    assert counts.held + counts.cached + counts.free == sched.pool.size


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_stream_finishes_whatever_the_pool_and_the_load(case: Case) -> None:
    rng = random.Random(case.seed)
    pool = BlockPool(blocks_for(case.context, case.block_size) + case.extra_blocks, case.block_size)
    cfg = SchedulerConfig(chunk=case.chunk, short_chunk=case.short_chunk, max_prefills=case.max_prefills, pacing=None)
    sched = PagedScheduler(cfg, pool, prefix=case.prefix, in_flight=case.in_flight)
    arrivals = sorted(enumerate(case.requests), key=lambda r: (r[1][0], r[0]))
    streams = []
    out: list[tuple[RaggedStep, dict[int, Proposal]]] = []
    for round_ in range(20_000):
        while arrivals and arrivals[0][1][0] <= round_:
            _, (_, prompt, answer, kind) = arrivals.pop(0)
            streams.append(Stream(new_stream_id(), _prompt(prompt, kind), SamplingParams(), answer,
                                  prefix_scope="k"))
            sched.add(streams[-1])
        drafts = _drafts(sched, rng)
        oldest = next(iter(sched.streams.values()), None)
        replays = oldest.replays if oldest is not None else 0
        steps = [s for s in sched.plan(drafts).steps if isinstance(s, RaggedStep)]
        assert oldest is None or oldest.replays == replays, "the oldest stream was preempted"
        out += [(s, drafts) for s in steps]
        _check_refs(sched)
        if not out:
            assert not sched.streams, f"stalled: nothing in flight, {len(sched.streams)} streams wait"
            if not arrivals:
                break
            continue
        step, offered = out.pop(rng.randrange(len(out)))
        _back(sched, step, offered, rng)
    assert not arrivals and not sched.streams, "streams still running after 20,000 rounds"
    assert all(len(s.generated) == s.max_tokens for s in streams)
    assert sched.pool.held == 0
