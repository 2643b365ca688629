"""Shared by the real-model tests: greedy decoding through a pipeline's step plans, and the
stages of an export driven directly (for what is about OpenVINO requests themselves)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from itertools import count

import numpy as np

from shardline.config import COMPACT_AT, SamplingConfig, SamplingParams
from shardline.pipeline.plan import Outcome, Pipeline, decode, prefill, run
from shardline.serving.engine import Engine, Event, Request, Ticket
from shardline.serving.speculation import Drafts
from shardline.stage.cache import KVBook, StepInputs
from shardline.stage.runner import StageRunner

GREEDY = SamplingParams()
_keys = count(1000)


def chunks(prompt: list[int], size: int | None) -> list[list[int]]:
    size = size or len(prompt)
    return [prompt[i : i + size] for i in range(0, len(prompt), size)]


def ok(outs: list[Outcome]) -> list[Outcome]:
    for o in outs:
        assert not o.failed, o.error
    return outs


def greedy_ours(pipe: Pipeline, prompt: list[int], n: int, chunk: int | None = None) -> tuple[list[int], np.ndarray]:
    """n greedy tokens (stop tokens ignored) and the logits row that chose each one; the prompt
    goes in chunks of `chunk` tokens (None: whole)."""
    key, book = next(_keys), KVBook()
    parts = chunks(prompt, chunk)
    try:
        for i, part in enumerate(parts):
            (out,) = ok(run(pipe, prefill(key, book, part, GREEDY, first=i == 0, last=i == len(parts) - 1,
                                          want_logits=True)))
        tokens, rows = [out.choices[0].token], [out.choices[0].logits]
        for _ in range(n - 1):
            (out,) = ok(run(pipe, decode(key, book, [tokens[-1]], GREEDY, want_logits=True)))
            tokens.append(out.choices[0].token)
            rows.append(out.choices[0].logits)
    finally:
        pipe.release(key)
    return tokens, np.stack([np.asarray(r) for r in rows])


def engine_tokens(pipe: Pipeline, prompt: list[int], cfg: SamplingConfig | None = None, chunk: int = 256,
                  drafts: Drafts | None = None, groups: int = 1, compact_at: int = COMPACT_AT) -> list[int]:
    """One request's tokens through an engine over `pipe` (stop tokens not honoured), with
    speculation when `drafts` is given."""
    from shardline.serving.admission import Limits
    from shardline.serving.generate import tokens
    from shardline.serving.scheduler import SchedulerConfig

    engine = Engine(pipe, Limits(1, 1), 8192, SchedulerConfig(chunk=chunk, groups=groups, compact_at=compact_at),
                    drafts)
    try:
        return tokens(engine, prompt, cfg or SamplingConfig(max_tokens=24))
    finally:
        engine.stop()


def chain(stages: list[StageRunner], key: object, inputs: StepInputs) -> np.ndarray:
    """One step through `stages` in this thread: logits [B, N, V] of the last position."""
    out = None
    for stage in stages:
        out = stage.run(key, inputs, out)
    assert out is not None
    return out


def staggered(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Stream i starts once stream i-1 has 3 tokens (so it joins running groups) and ends after
    lengths[i] tokens (so groups lose rows mid-way)."""
    got: list[list[int]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def collect(i: int) -> Callable[[Event], None]:
        def on(ev: Event) -> None:
            if ev.token is not None:
                got[i].append(ev.token)
                if len(got[i]) == 3:
                    started[i].set()
            else:
                assert ev.finish == "length", ev
                started[i].set()
                done[i].set()
        return on

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        if i:
            assert started[i - 1].wait(120)
        engine.submit(Request(p, SamplingConfig(max_tokens=n), frozenset()), collect(i))
    for d in done:
        assert d.wait(120)
    return got


class Faulty:
    """Requests through `engine`; once every stream has `at` tokens, `fault()` runs on the engine
    thread (the engine waits for it: the fault lands mid-generation, at a known point)."""

    def __init__(self, engine: Engine, prompts: list[list[int]], at: int, fault: Callable[[], None],
                 max_tokens: int) -> None:
        self.events: list[list[Event]] = [[] for _ in prompts]
        self.faulted = threading.Event()
        self._at, self._fault = at, fault
        self._done = threading.Semaphore(0)
        self.tickets: list[Ticket] = [engine.submit(Request(p, SamplingConfig(max_tokens=max_tokens), frozenset()),
                                                    self._on(i)) for i, p in enumerate(prompts)]

    def _on(self, i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            self.events[i].append(ev)
            if not self.faulted.is_set() and all(len(e) >= self._at for e in self.events):
                self._fault()
                self.faulted.set()
            if ev.finish:
                self._done.release()
        return event

    def finals(self, timeout_s: float) -> list[Event]:
        for _ in self.events:
            assert self._done.acquire(timeout=timeout_s)
        return [e[-1] for e in self.events]

    def tokens(self) -> list[list[int]]:
        return [[e.token for e in events if e.token is not None] for events in self.events]
