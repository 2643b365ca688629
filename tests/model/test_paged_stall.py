"""Issue 54's stall on the default model's paged export: `serve --kv-cache-mb 92 --context 2048`
(65 blocks of 32 tokens; one stream at the context needs 64). Two ~2,000-token prompts at once
took the pool a chunk at a time until neither could finish, and hung every later request. Now
`serve` lets one prompt prefill at a time on that pool (it says why); and the scheduler, even
let to prefill 8 at once, lets the younger prompts wait for the older ones' blocks: 2, 4 and 8
long prompts at once and a short chat beside them are all answered, each long answer the one
it gets alone. A long prompt here is 1,200 tokens, 38 blocks: two of them do not fit the pool
together, the audit's case at about half its prefill time. One pipeline serves every case
(engines over it one after the other)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig, ServeConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.paged_local import PagedPipeline
from shardline.server import open_engine, scheduling
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from tests.conftest import CHAT_PROMPTS, DEFAULT_SPLIT

CONTEXT, KV_MIB, ANSWER, LONG = 2048, 92, 8, 1200
WORDS = ("river", "stone", "market", "lantern", "orchard", "signal", "harbor", "engine", "winter", "copper",
         "meadow", "bridge", "candle", "forest", "ledger", "window", "garden", "pocket", "thunder", "silver")


@pytest.fixture(scope="module")
def opened(shards: Callable[..., Path]) -> Iterator[tuple[PagedPipeline, int, list[str]]]:
    """The audit's pool through `serve`'s own path (server.open_engine, asked for --max-prefills
    8), what it lets prefill at once and what it logged; its engine stops and the pipeline
    serves the cases below."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("shardline.server")
    log.addHandler(handler)
    try:
        engine, _ = open_engine(shards("gguf", layers=DEFAULT_SPLIT, paged=True), RunConfig(context=CONTEXT),
                                ServeConfig(kv_cache_mb=KV_MIB, max_prefills=8))
    finally:
        log.removeHandler(handler)
    pipe = engine.pipe
    assert isinstance(pipe, PagedPipeline) and isinstance(engine.scheduler, PagedScheduler)
    engine.stop()
    try:
        yield pipe, engine.scheduler.cfg.max_prefills, said
    finally:
        pipe.shutdown()


@pytest.fixture(scope="module")
def pipe(opened: tuple[PagedPipeline, int, list[str]]) -> PagedPipeline:
    return opened[0]


def test_serve_lets_one_prompt_prefill_at_a_time_on_the_audit_s_pool(
        opened: tuple[PagedPipeline, int, list[str]]) -> None:
    pipe, prefills, said = opened
    assert (pipe.blocks, pipe.block_size, prefills) == (65, 32, 1)
    assert "--max-prefills 8 lowered to 1: the KV pool (91 MiB, --kv-cache-mb) of 65 blocks of 32 tokens holds " \
           "1 stream(s) at --context 2048 (64 blocks each); --kv-cache-mb 720 holds 8, or give a smaller --context" \
           in said


@pytest.fixture(scope="module")
def prompts(pipe: PagedPipeline, shards: Callable[..., Path]) -> list[list[int]]:
    """Four distinct chats of 1,200 tokens (seeded words: the pool holds one at a time), and a short one."""
    tok = ChatTokenizer(shards("gguf", layers=DEFAULT_SPLIT, paged=True))
    out = []
    for seed in range(4):
        rng = random.Random(seed)
        words = " ".join(rng.choice(WORDS) for _ in range(LONG + 100))
        ids = tok.encode_chat([{"role": "user", "content": f"Which word comes most often here? {words}"}])
        out.append(ids[-LONG:])  # its last 1,200 tokens (its chat's end kept)
    return [*out, tok.encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])]


def _engine(pipe: PagedPipeline) -> Engine:
    """`serve`'s scheduling on this pool without the start-time limit: 8 prompts may prefill at once."""
    cfg = scheduling(ServeConfig(max_prefills=8), pipe.manifest, False)
    scheduler = PagedScheduler(cfg, BlockPool(pipe.blocks, pipe.block_size), block_bytes=pipe.block_bytes)
    return Engine(pipe, Limits(16, 16), pipe.context, scheduler=scheduler)


def _answers(pipe: PagedPipeline, batches: list[list[list[int]]]) -> list[list[list[int]]]:
    """Each batch's prompts submitted at once, the next batch once every answer is in."""
    engine = _engine(pipe)
    try:
        return [_at_once(engine, batch) for batch in batches]
    finally:
        engine.stop()
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.pool.held == 0 and engine.stalled is None


def _at_once(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    got: list[list[int]] = [[] for _ in batch]
    left = threading.Semaphore(0)

    def on(i: int) -> Callable[[Event], None]:
        def collect(ev: Event) -> None:
            if ev.token is not None:
                got[i].append(ev.token)
            else:
                assert ev.finish == "length", ev
                left.release()
        return collect

    for i, p in enumerate(batch):
        engine.submit(Request(p, SamplingConfig(max_tokens=ANSWER), frozenset()), on(i))
    until = time.monotonic() + 600
    for _ in batch:
        while not left.acquire(timeout=0.5):  # /health would have said so (the stall it reported)
            assert engine.stalled is None and time.monotonic() < until, engine.stalled or "not every one answered"
    return got


@pytest.fixture(scope="module")
def alone(pipe: PagedPipeline, prompts: list[list[int]]) -> list[list[int]]:
    return [a for (a,) in _answers(pipe, [[p] for p in prompts])]


def test_the_audit_s_prompts_are_long(prompts: list[list[int]]) -> None:
    pool = 65 * 32
    assert all(pool // 2 < len(p) + ANSWER <= CONTEXT for p in prompts[:4]) and len(prompts[4]) < 64
    assert len({tuple(p) for p in prompts}) == 5


@pytest.mark.parametrize("n", [2, 4, 8])
def test_long_prompts_at_once_and_a_chat_are_all_answered_as_alone(pipe: PagedPipeline, prompts: list[list[int]],
                                                                   alone: list[list[int]], n: int) -> None:
    """n long prompts (8: the four twice) and the short chat after them, all at once."""
    batch = [prompts[i % 4] for i in range(n)] + [prompts[4]]
    (got,) = _answers(pipe, [batch])
    assert got == [alone[i % 4] for i in range(n)] + [alone[4]]
