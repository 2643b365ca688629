"""Prefix reuse (issue 26): an ended stream's KV is kept and a later prompt that starts with its
tokens prefills only the rest. The tokens are a cold run's, token for token: greedy at 1 and 2
stages, with decode groups and with speculation, and seeded sampling alike; scopes (API keys)
never share, and a request that opts out neither reuses nor is kept."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LOOKUP_PRIOR, LookupDrafter
from shardline.serving.engine import Engine, Request
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.conftest import CHAT_PROMPTS

GREEDY = SamplingConfig(max_tokens=24)
MIB = 1 << 20


def _ask(engine: Engine, prompt: list[int], sampling: SamplingConfig = GREEDY, scope: str = "",
         cache: bool = True) -> list[int]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(prompt, sampling, frozenset(), scope=scope, cache_prompt=cache), events.put)
    out = []
    while (ev := events.get(timeout=300)).token is not None:
        out.append(ev.token)
    assert ev.finish == "length", ev.error
    return out


@pytest.fixture(scope="module")
def turns(shards: Callable[..., Path]) -> list[list[int]]:
    """Two prompts: a system prompt and a question, and that again with another question."""
    tok = ChatTokenizer(shards("gguf", stages=1))
    system = {"role": "system", "content": " ".join(CHAT_PROMPTS[:3])}
    return [tok.encode_chat([system, {"role": "user", "content": q}]) for q in CHAT_PROMPTS[3:5]]


def _engine(pipe: LocalPipeline, prefix: PrefixCache | None, groups: int = 1,
            drafts: Drafts | None = None) -> Engine:
    return Engine(pipe, Limits(2, 2), pipe.context, SchedulerConfig(chunk=32, groups=groups), drafts, prefix=prefix)


def _cache(pipe: LocalPipeline, mib: int = 64) -> PrefixCache:
    return PrefixCache(mib * MIB, sum(s.slot_bytes for s in pipe.layout()))


@pytest.fixture
def engines(request: pytest.FixtureRequest,
            shards: Callable[..., Path]) -> Iterator[tuple[Engine, Engine, PrefixCache]]:
    """(cold, warm, the warm one's cache), each over its own pipeline (an engine takes every
    outcome of its pipeline): `request.param` = (stages, groups, speculate)."""
    stages, groups, speculate = request.param
    folder = shards("gguf", stages=stages)
    with LocalPipeline(folder) as one, LocalPipeline(folder) as other:
        drafts = Drafts(LookupDrafter, 4, 8, LOOKUP_PRIOR) if speculate else None
        cache = _cache(other)
        cold, warm = _engine(one, None, groups, drafts), _engine(other, cache, groups, drafts)
        try:
            yield cold, warm, cache
        finally:
            cold.stop()
            warm.stop()


@pytest.mark.parametrize("engines", [(1, 0, False), (2, 1, False), (2, 1, True)], indirect=True,
                         ids=["1 stage", "2 stages, groups", "2 stages, groups, speculation"])
def test_a_next_turn_starts_from_the_kept_conversation_and_gives_the_cold_tokens(
        engines: tuple[Engine, Engine, PrefixCache], turns: list[list[int]]) -> None:
    cold, warm, cache = engines
    first = _ask(warm, turns[0])
    assert first == _ask(cold, turns[0])
    follow = turns[0] + first + turns[1][-12:]  # the answer, then a new question
    assert _ask(warm, follow) == _ask(cold, follow)
    assert (cache.stats.hits, cache.stats.kept) == (1, 3)  # the first prompt once in, then each conversation
    assert len(cache.entries) == 1  # the entries before went: the last conversation holds each of them whole
    assert cache.stats.tokens_saved == len(turns[0]) + len(first) - 1  # the last answer token was never fed
    other = turns[1]  # the same system prompt, another question
    saved = cache.stats.tokens_saved
    assert _ask(warm, other) == _ask(cold, other)
    shared = next(i for i, (a, b) in enumerate(zip(turns[0], other, strict=False)) if a != b)
    assert cache.stats.hits == 2 and cache.stats.tokens_saved - saved == shared >= 16


def test_a_flood_of_distinct_prompts_stays_within_the_budget_and_the_stages_hold_the_entries_alone(
        shards: Callable[..., Path]) -> None:
    """A budget of about 3 entries, 12 distinct prompts: after each request the bytes kept are
    within it, and every stage holds exactly the kept entries' leases (nothing evicted lingers)."""
    with LocalPipeline(shards("gguf", stages=2)) as pipe:
        slot = sum(s.slot_bytes for s in pipe.layout())
        cache = PrefixCache(140 * slot, slot)
        engine = _engine(pipe, cache)
        tok = ChatTokenizer(shards("gguf", stages=2))
        try:
            for i in range(12):
                prompt = tok.encode_chat([{"role": "user", "content": f"Request {i}: " + CHAT_PROMPTS[i % 5] * 2}])
                _ask(engine, prompt, SamplingConfig(max_tokens=8))
                assert engine.prefix_stats()[1] <= cache.budget
        finally:
            engine.stop()
    # After the pipeline's shutdown: every release the engine submitted has run on every stage
    # (the last stream's group is released by the plan after it ends, on the stage threads).
    assert cache.stats.evicted >= 6 and 1 <= len(cache.entries) <= 4
    held = {e.lease for e in cache.entries}
    assert all(set(stage.keys()) == held for stage in pipe.stages), [stage.keys() for stage in pipe.stages]


def test_prompts_arriving_together_prefill_their_shared_system_prompt_once(shards: Callable[..., Path]) -> None:
    """Four requests at once, one system prompt: the first prefills it, the other three wait for
    it to be kept and start from it (three hits, the shared part saved three times), and every
    answer is a cold run's, token for token (2 stages, decode groups)."""
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    system = {"role": "system", "content": " ".join(CHAT_PROMPTS[:3])}
    prompts = [tok.encode_chat([system, {"role": "user", "content": f"Question {i}: why?"}]) for i in range(4)]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b)
    with LocalPipeline(folder) as one, LocalPipeline(folder) as other:
        cold = _engine(one, None)
        cache = _cache(other)
        warm = Engine(other, Limits(4, 4), other.context, SchedulerConfig(chunk=32, groups=1), prefix=cache)
        try:
            queues: list[queue.Queue] = [queue.Queue() for _ in prompts]
            for p, q in zip(prompts, queues, strict=True):
                warm.submit(Request(p, GREEDY, frozenset()), q.put)
            together = [_tokens(q) for q in queues]
            assert together == [_ask(cold, p) for p in prompts]
        finally:
            cold.stop()
            warm.stop()
    assert (cache.stats.hits, cache.stats.tokens_saved) == (3, 3 * shared)


def _tokens(events: queue.Queue) -> list[int]:
    out = []
    while (ev := events.get(timeout=300)).token is not None:
        out.append(ev.token)
    assert ev.finish == "length", ev.error
    return out
