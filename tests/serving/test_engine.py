"""The serving engine on the real model: concurrent streams return exactly what each returns
alone, streams join while others run, cancellation frees the stream, and the bounded queue."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.generate import generate
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Overloaded, Request, Ticket
from tests.conftest import CHAT_PROMPTS

N_NEW = 20


class Collector:
    """Events of one ticket, with a flag set on the final one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finish:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish if self.events and self.events[-1].finish else None


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def prompts(two: Path) -> list[list[int]]:
    tok = ChatTokenizer(two)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def alone(two: Path, prompts: list[list[int]]) -> list[list[int]]:
    pipe = LocalPipeline(two, RunConfig())
    return [list(generate(pipe, p, SamplingConfig(max_tokens=N_NEW), set(), 8192)) for p in prompts]


@pytest.fixture(params=[0, 2], ids=["interleaved", "batched"])
def engine(two: Path, request: pytest.FixtureRequest) -> Iterator[Engine]:
    # 0 groups: one infer call per stream per step; 2: each group's streams share a call.
    pipe = LocalPipeline(two, RunConfig(), groups=request.param)
    eng = Engine(pipe, Limits(max_streams=4, max_queue=2), max_context=8192)
    yield eng
    eng.stop()


def _submit(engine: Engine, prompt: list[int], n: int = N_NEW, seed: int | None = None,
            temperature: float = 0.0) -> tuple[Ticket, Collector]:
    c = Collector()
    cfg = SamplingConfig(max_tokens=n, temperature=temperature, seed=seed)
    return engine.submit(Request(prompt, cfg, frozenset()), c), c


def test_concurrent_streams_equal_alone(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    # 5 requests, 4 stream slots: the fifth waits in the queue and starts when one finishes.
    runs = [_submit(engine, p) for p in prompts]
    for _, c in runs:
        assert c.done.wait(120)
    assert [c.tokens for _, c in runs] == alone
    assert [c.finish for _, c in runs] == ["length"] * len(prompts)
    assert engine.active == 0 and engine.waiting == 0


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
    assert engine.pipe.stages[0]._streams == {}  # type: ignore[attr-defined]  # every KV freed


def test_sampled_streams_are_seeded(engine: Engine, prompts: list[list[int]]) -> None:
    a = [_submit(engine, prompts[0], seed=7, temperature=0.8) for _ in range(2)]
    b = _submit(engine, prompts[0], seed=8, temperature=0.8)
    for _, c in [*a, b]:
        assert c.done.wait(120)
    assert a[0][1].tokens == a[1][1].tokens != b[1].tokens


def test_queue_bound_and_context_limit(two: Path, prompts: list[list[int]]) -> None:
    eng = Engine(LocalPipeline(two, RunConfig()), Limits(max_streams=1, max_queue=1), max_context=64)
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
