"""The serving engine on the real model: concurrent streams return exactly what each returns
alone (with and without decode groups, whole and chunked prompts), streams join while others
run, a long prompt does not hold running streams, cancellation frees the stream, seeded
sampling depends on nothing but the request, the bounded queue, and failures stay contained."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, EngineFailed, Event, Overloaded, Request, Ticket
from shardline.serving.generate import tokens
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours

N_NEW = 20


class Collector:
    """Events of one ticket, with a flag set on the final one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()
        self.times: list[float] = []

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        self.times.append(time.perf_counter())
        if ev.finish:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish if self.events and self.events[-1].finish else None


@pytest.fixture(scope="module")
def prompts(two: Path) -> list[list[int]]:
    tok = ChatTokenizer(two)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def alone(pipe: LocalPipeline, prompts: list[list[int]]) -> list[list[int]]:
    return [greedy_ours(pipe, p, N_NEW)[0] for p in prompts]


@pytest.fixture(params=[(0, 256), (2, 256), (1, 8)], ids=["interleaved", "batched", "batched-chunked"])
def engine(pipe: LocalPipeline, request: pytest.FixtureRequest) -> Iterator[Engine]:
    # 0 groups: one infer call per stream per step; 2: each group's streams share a call;
    # chunks of 8 prompt tokens: every prompt goes in several steps between decode steps.
    groups, chunk = request.param
    eng = Engine(pipe, Limits(max_streams=4, max_queue=2), 8192, SchedulerConfig(chunk=chunk, groups=groups))
    yield eng
    eng.stop()


def _submit(engine: Engine, prompt: list[int], n: int = N_NEW, seed: int | None = None,
            temperature: float = 0.0, on_event: Callable[[Event], None] | None = None) -> tuple[Ticket, Collector]:
    c = Collector()
    cfg = SamplingConfig(max_tokens=n, temperature=temperature, seed=seed)
    return engine.submit(Request(prompt, cfg, frozenset()), on_event or c), c


def _keys_freed(pipe: LocalPipeline) -> bool:
    deadline = time.monotonic() + 10  # releases run on the stage threads, after the last outcome
    while any(s.keys() for s in pipe.stages) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all(not s.keys() for s in pipe.stages)


def test_concurrent_streams_equal_alone(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    # 5 requests, 4 stream slots: the fifth waits in the queue and starts when one finishes.
    runs = [_submit(engine, p) for p in prompts]
    for _, c in runs:
        assert c.done.wait(120)
    assert [c.tokens for _, c in runs] == alone
    assert [c.finish for _, c in runs] == ["length"] * len(prompts)
    assert engine.active == 0 and engine.waiting == 0
    assert _keys_freed(engine.pipe)  # type: ignore[arg-type]


def test_joins_while_others_run(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    _, first = _submit(engine, prompts[0])
    while len(first.events) < 5:  # the first stream is mid-way when the second arrives
        assert not first.done.wait(0.01)
    _, second = _submit(engine, prompts[1])
    assert second.done.wait(120) and first.done.wait(120)
    assert first.tokens == alone[0] and second.tokens == alone[1]


def test_cancel_frees_stream_others_finish(engine: Engine, prompts: list[list[int]],
                                           alone: list[list[int]]) -> None:
    ticket, victim = _submit(engine, prompts[2], n=200)
    _, other = _submit(engine, prompts[3])
    while len(victim.events) < 3:
        assert not victim.done.wait(0.01)
    engine.cancel(ticket)
    assert victim.done.wait(30)
    assert victim.finish == "cancelled" and len(victim.tokens) < 200
    assert other.done.wait(120) and other.tokens == alone[3]
    assert engine.active == 0
    assert _keys_freed(engine.pipe)  # type: ignore[arg-type]  # every KV freed


def test_a_long_prompt_does_not_hold_running_streams(pipe: LocalPipeline, prompts: list[list[int]]) -> None:
    """A 600-token prompt arrives while a stream decodes: in chunks of 32 the running stream
    keeps making tokens while the prompt is prefilled (whole, it would wait for all of it)."""
    eng = Engine(pipe, Limits(4, 2), 8192, SchedulerConfig(chunk=32, groups=1))
    try:
        _, running = _submit(eng, prompts[0], n=120)
        while len(running.events) < 3:
            assert not running.done.wait(0.01)
        submitted = time.perf_counter()
        _, long = _submit(eng, (prompts[1] * 30)[:600], n=1)
        assert long.done.wait(120) and running.done.wait(120)
        first_long = long.times[0]
        during = [t for t in running.times if submitted < t < first_long]
        assert len(during) >= 10, f"only {len(during)} tokens of the running stream during the prefill"
    finally:
        eng.stop()


def test_paced_chunks_change_no_token(pipe: LocalPipeline, prompts: list[list[int]]) -> None:
    """A 600-token prompt prefilled while two streams decode goes in chunks the pacing sizes from
    its measured costs (serving/pacing.py: sizes that vary with the context and the streams'
    pace), and its greedy tokens, and the running streams', are those of each alone."""
    long = (prompts[1] * 30)[:600]
    eng = Engine(pipe, Limits(4, 2), 8192, SchedulerConfig(chunk=128, groups=1))
    sizes: list[int] = []
    plan = eng.scheduler._chunk

    def spy(s, n):  # type: ignore[no-untyped-def]
        sizes.append(n) if s.prompt == long else None
        return plan(s, n)

    eng.scheduler._chunk = spy  # type: ignore[method-assign]
    try:
        running = [_submit(eng, prompts[k], n=60) for k in (0, 2)]
        while min(len(c.events) for _, c in running) < 5:
            time.sleep(0.005)
        _, paced = _submit(eng, long, n=12)
        assert paced.done.wait(300) and all(c.done.wait(300) for _, c in running)
    finally:
        eng.stop()
    assert sum(sizes) == 600 and len(set(sizes)) > 2, sizes  # paced: several sizes, not 128s
    assert paced.tokens == greedy_ours(pipe, long, 12)[0]
    assert [c.tokens for _, c in running] == [greedy_ours(pipe, prompts[k], 60)[0] for k in (0, 2)]


def test_seeded_sampling_does_not_depend_on_batching_chunks_or_split(
        shards: Callable[..., Path], pipe: LocalPipeline, prompts: list[list[int]]) -> None:
    """The same request gives the same tokens alone or in a group, whole or chunked, on one
    stage or two: randomness depends only on (seed, position)."""
    def run(p: LocalPipeline, cfg: SchedulerConfig, company: int) -> list[int]:
        eng = Engine(p, Limits(4, 4), 8192, cfg)
        try:
            others = [_submit(eng, prompts[k + 1], n=30, seed=k, temperature=0.9) for k in range(company)]
            got = tokens(eng, prompts[0], SamplingConfig(max_tokens=30, temperature=0.9, seed=11))
            for _, c in others:
                assert c.done.wait(120)
            return got
        finally:
            eng.stop()

    base = run(pipe, SchedulerConfig(groups=0), 0)
    assert run(pipe, SchedulerConfig(groups=1, chunk=7), 3) == base
    with LocalPipeline(shards("gguf", stages=1), RunConfig()) as one:
        assert run(one, SchedulerConfig(groups=1), 2) == base
    eng = Engine(pipe, Limits(1, 1), 8192)
    try:  # and another seed gives other tokens (else the test could not fail)
        assert tokens(eng, prompts[0], SamplingConfig(max_tokens=30, temperature=0.9, seed=12)) != base
    finally:
        eng.stop()


def test_a_replayed_stream_continues_with_the_same_tokens(pipe: LocalPipeline, prompts: list[list[int]]) -> None:
    """Replay after a fault: the prompt plus the tokens already made, prefilled again with the
    same seed, continue exactly as the stream would have (each token's randomness comes from
    its position, which the replay keeps)."""
    eng = Engine(pipe, Limits(2, 2), 8192, SchedulerConfig(chunk=16))
    try:
        cfg = SamplingConfig(max_tokens=30, temperature=0.9, seed=5)
        whole = tokens(eng, prompts[2], cfg)
        replay = tokens(eng, prompts[2] + whole[:12], SamplingConfig(max_tokens=18, temperature=0.9, seed=5))
        assert len(whole) == 30 and replay == whole[12:]
    finally:
        eng.stop()


def test_queue_bound_and_context_limit(pipe: LocalPipeline, prompts: list[list[int]]) -> None:
    eng = Engine(pipe, Limits(max_streams=1, max_queue=1), max_context=64)
    try:
        with pytest.raises(Exception, match="exceeds the context of 64"):
            _submit(eng, prompts[0], n=40)
        runs = [_submit(eng, prompts[0], n=8), _submit(eng, prompts[1], n=8)]
        with pytest.raises(Overloaded, match=r"all 1 streams are busy and [12] requests are waiting"):
            _submit(eng, prompts[2], n=8)
        for _, c in runs:
            assert c.done.wait(60) and c.finish == "length"
    finally:
        eng.stop()


def test_a_failing_stream_fails_alone(pipe: LocalPipeline, prompts: list[list[int]], alone: list[list[int]]) -> None:
    """A prompt with token ids outside the vocabulary is refused by stage 0, and a caller whose
    event callback raises fails its own stream: the others finish, the engine stays healthy."""
    eng = Engine(pipe, Limits(4, 4), 8192)
    try:
        _, bad_ids = _submit(eng, [1, 2, 10**9])
        broken = Collector()

        def explode(ev: Event) -> None:
            broken(ev)
            if ev.token is not None:
                raise RuntimeError("a bug in a caller")

        _, _ = _submit(eng, prompts[1], on_event=explode)
        _, good = _submit(eng, prompts[0])
        for c in (bad_ids, broken, good):
            assert c.done.wait(120)
        assert bad_ids.finish == "error" and "outside the vocabulary" in bad_ids.events[-1].error
        assert broken.finish == "error" and "a bug in a caller" in broken.events[-1].error
        assert good.tokens == alone[0] and eng.failed is None
        assert _keys_freed(pipe)
    finally:
        eng.stop()


class _Crashing(LocalPipeline):
    """Fault injection: the pipeline's outcome queue breaks once a stream is running."""

    armed = False

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        got = super().outcomes(timeout)
        if self.armed and got:
            raise RuntimeError("the outbox is corrupt")
        return got


def test_a_dead_engine_thread_says_so_and_ends_every_request(two: Path, prompts: list[list[int]]) -> None:
    with _Crashing(two, RunConfig()) as crashing:
        eng = Engine(crashing, Limits(1, 2), 8192)
        try:
            crashing.armed = True
            runs = [_submit(eng, prompts[0]), _submit(eng, prompts[1])]  # one runs, one waits
            for _, c in runs:
                assert c.done.wait(60)
                assert c.finish == "error" and "the outbox is corrupt" in c.events[-1].error
            assert eng.failed is not None and "the outbox is corrupt" in eng.failed
            with pytest.raises(EngineFailed, match="the engine has stopped"):
                _submit(eng, prompts[2])
        finally:
            eng.stop()
