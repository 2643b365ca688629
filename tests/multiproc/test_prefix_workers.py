"""Prefix reuse through real worker processes on loopback (issue 26): every worker holds the
kept entries and copies them when the plan says (wire KvCopy), in a chain and a star; a later
turn gives the in-process cold tokens, with decode groups and speculation; a worker that
restarted holds nothing, so the next reuse is a miss with the right answer, never a wrong one;
a copy a worker cannot make fails that copy alone."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shardline.config import RunConfig, SamplingConfig, SamplingParams
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import KvCopy, Pipeline, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.server import process_slot_bytes
from shardline.serving.admission import Limits
from shardline.serving.drafters import LOOKUP_PRIOR, LookupDrafter
from shardline.serving.engine import Engine, Request
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.cache import KVBook
from tests.conftest import CHAT_PROMPTS
from tests.multiproc.procs import Proc, worker

GREEDY = SamplingConfig(max_tokens=16)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


@pytest.fixture(scope="module")
def turns(three: Path) -> list[list[int]]:
    tok = ChatTokenizer(three)
    system = {"role": "system", "content": " ".join(CHAT_PROMPTS)}
    return [tok.encode_chat([system, {"role": "user", "content": q}]) for q in CHAT_PROMPTS[:2]]


def _ask(engine: Engine, prompt: list[int]) -> list[int]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(prompt, GREEDY, frozenset()), events.put)
    out = []
    while (ev := events.get(timeout=WAIT_S)).token is not None:
        out.append(ev.token)
    assert ev.finish == "length", ev.error
    return out


def _engine(pipe: Pipeline, prefix: PrefixCache | None, drafts: Drafts | None = None) -> Engine:
    return Engine(pipe, Limits(2, 2), 8192, SchedulerConfig(chunk=32, groups=1), drafts, prefix=prefix)


@pytest.fixture(scope="module")
def cold(three: Path, turns: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Every prompt these tests ask, answered with every stage in this process and no cache."""
    first = turns[0]
    asked = [first, turns[1]]
    with LocalPipeline(three) as pipe:
        engine = _engine(pipe, None)
        try:
            answer = _ask(engine, first)
            asked.append(first + answer + turns[1][-10:])
            return {tuple(p): _ask(engine, p) for p in asked}
        finally:
            engine.stop()


@pytest.fixture
def chain(three: Path, request: pytest.FixtureRequest) -> Iterator[tuple[list[Proc], RemotePipeline]]:
    """Stages 1 and 2 on workers, in a chain (or a star, as the test's `topology` parameter says)."""
    ws = [worker(three, "1"), worker(three, "2")]
    topology = getattr(request, "param", "chain")
    pipe = RemotePipeline(three, [w.addr for w in ws], RunConfig(), "f32", topology, reconnect_s=60)
    yield ws, pipe
    pipe.shutdown()
    for w in ws:
        w.stop()


def _cache(pipe: Pipeline) -> PrefixCache:
    return PrefixCache(64 << 20, process_slot_bytes(pipe.layout(), pipe.placement()))


def _settle(engine: Engine) -> None:
    reuse = engine.scheduler.reuse
    assert reuse is not None
    deadline = time.monotonic() + WAIT_S
    while not reuse.settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reuse.settled()


@pytest.mark.parametrize("chain, speculate", [("chain", False), ("chain", True), ("star", False)], indirect=["chain"],
                         ids=["chain", "chain, speculation", "star"])
def test_a_later_turn_through_workers_starts_from_their_kept_copy_and_gives_the_cold_tokens(
        chain: tuple[list[Proc], RemotePipeline], turns: list[list[int]], cold: dict[tuple[int, ...], list[int]],
        speculate: bool) -> None:
    _, pipe = chain
    cache = _cache(pipe)
    engine = _engine(pipe, cache, Drafts(LookupDrafter, 4, 8, LOOKUP_PRIOR) if speculate else None)
    try:
        first = _ask(engine, turns[0])
        assert first == cold[tuple(turns[0])]
        follow = turns[0] + first + turns[1][-10:]
        assert _ask(engine, follow) == cold[tuple(follow)]
        assert _ask(engine, turns[1]) == cold[tuple(turns[1])]
    finally:
        engine.stop()
    assert cache.stats.hits == 2 and cache.stats.tokens_saved > len(turns[0]) + len(first) - 2
    # one slot costs the most on the coordinator or a worker: a third of the layers each, roughly
    assert process_slot_bytes(pipe.layout(), pipe.placement()) < sum(s.slot_bytes for s in pipe.layout())


def test_after_a_worker_restarts_the_kept_prefix_is_a_miss_with_the_right_answer(
        three: Path, chain: tuple[list[Proc], RemotePipeline], turns: list[list[int]],
        cold: dict[tuple[int, ...], list[int]]) -> None:
    ws, pipe = chain
    cache = _cache(pipe)
    engine = _engine(pipe, cache)
    try:
        first = _ask(engine, turns[0])
        _settle(engine)  # its KV is kept on every worker
        ws[1].proc.send_signal(signal.SIGKILL)
        ws[1].stop()
        ws[1] = worker(three, "2", port=ws[1].port)  # empty: it holds no entry
        follow = turns[0] + first + turns[1][-10:]
        assert _ask(engine, follow) == cold[tuple(follow)]
        assert cache.stats.hits == 1 and cache.stats.tokens_saved == 0  # the copy failed: prefilled cold
        assert _ask(engine, turns[1]) == cold[tuple(turns[1])]  # kept again after the restart: a hit
        assert cache.stats.hits == 2 and cache.stats.tokens_saved > 0
    finally:
        engine.stop()


def test_a_copy_a_worker_cannot_make_fails_alone_and_the_chain_serves_on(
        chain: tuple[list[Proc], RemotePipeline], turns: list[list[int]]) -> None:
    _, pipe = chain
    book = KVBook()
    (out,) = run(pipe, prefill(7, book, turns[0][:20], SamplingParams(), first=True, last=True))
    assert not out.error
    for bad, why in ((KvCopy(7, 8, np.arange(21)), "slots 0-20 of row 0 of a state of 1 rows of 20 slots"),
                     (KvCopy(7, 8, np.arange(4), row=1), "row 1"),
                     (KvCopy(99, 8, np.arange(4)), "unknown key 99")):
        pipe.move(bad)
        with pytest.raises(ShardlineError, match=why):
            bad.done.result(WAIT_S)
    good = KvCopy(7, 8, np.arange(12))
    pipe.move(good)
    good.done.result(WAIT_S)
    again = KvCopy(7, 8, np.arange(12))  # 8 is open now: refused, and 8 left as it is
    pipe.move(again)
    with pytest.raises(ShardlineError, match="already open"):
        again.done.result(WAIT_S)
    (step,) = run(pipe, prefill(8, KVBook.filled(12), turns[0][12:20], SamplingParams(), first=False, last=True))
    assert step.choices[0].token == out.choices[0].token  # the copy's 12 slots, then the 8 after them
    pipe.release(7)
    pipe.release(8)
