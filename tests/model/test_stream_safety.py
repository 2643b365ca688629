"""Several InferRequests of ONE compiled model on the OpenVINO CPU plugin, one per stream.

A paper serving many streams hit a bug on GPU when streams that shared a compiled model were
reset or closed independently, and paid one compile per stream to avoid it. shardline compiles
each stage once and gives every stream its own InferRequest (its own ReadValue/Assign KV
state), so here we check on the CPU plugin, with the real model and exact precision, that:
(a) streams interleaved step by step produce exactly the tokens each produces alone;
(b) resetting a stream in place, or closing it and opening a new one, changes no other
    stream's tokens, and the restarted stream reproduces its own tokens;
(c) the same holds with requests running at the same time: from two Python threads (each
    driving its own streams), and with `start_async` + `wait` on several requests at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import RunConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.stage.cache import KVBook
from tests.conftest import CHAT_PROMPTS
from tests.helpers import chain, greedy_ours

N = 24  # greedy tokens per stream


@dataclass
class Setup:
    pipe: LocalPipeline
    prompts: list[list[int]]
    alone: list[list[int]]  # the tokens of each prompt run alone (one stream open at a time)


def _setup(folder: Path, run: RunConfig) -> Setup:
    pipe = LocalPipeline(folder, run)
    tok = ChatTokenizer(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT_PROMPTS[:3]]
    with LocalPipeline(folder, run) as reference:
        alone = [greedy_ours(reference, p, N)[0] for p in prompts]
    # Different prompts must give different generations, or a mix-up between streams would pass.
    assert len({tuple(a) for a in alone}) == len(alone)
    return Setup(pipe, prompts, alone)


@pytest.fixture(scope="module", params=[1, 2], ids=["1stage", "2stages"])
def setup(request: pytest.FixtureRequest, shards: Callable[..., Path]) -> Setup:
    return _setup(shards("gguf", stages=request.param), RunConfig(precision="exact"))


_keys = count()


class Driven:
    """One stream on a pipeline's stages driven a step at a time in the caller's thread: its
    prompt, then its own greedy tokens."""

    def __init__(self, pipe: LocalPipeline, prompt: list[int]) -> None:
        self.pipe, self.prompt = pipe, prompt
        self.stream = self._open()
        self.tokens: list[int] = []
        self.before: list[list[int]] = []  # tokens made before each reset or reopen
        self.spans: list[tuple[float, float]] = []  # wall time of each step (for the thread test)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= N

    def _open(self) -> int:
        key = next(_keys)
        for stage in self.pipe.stages:
            stage.open(key)
        self.book = KVBook()
        return key

    def step(self) -> None:
        inputs = self.book.plan([self.tokens[-1]] if self.tokens else self.prompt)
        start = time.perf_counter()
        logits = chain(self.pipe.stages, self.stream, inputs)
        self.book.commit(inputs)
        self.spans.append((start, time.perf_counter()))
        self.tokens.append(int(np.argmax(logits[0, -1])))

    def reset(self) -> None:
        """Clear the KV in place: the same InferRequests, `reset_state()` on each stage."""
        for stage in self.pipe.stages:
            stage.reset(self.stream)
        self.book.reset()
        self.before.append(self.tokens)
        self.tokens = []

    def reopen(self) -> None:
        """Close the stream (its requests are destroyed) and start over on a new one."""
        self.close()
        self.stream = self._open()
        self.before.append(self.tokens)
        self.tokens = []

    def close(self) -> None:
        for stage in self.pipe.stages:
            stage.close(self.stream)


def _tick(runs: list[Driven], t: int) -> None:
    """Round robin, newest stream first: run k starts at tick k, so the order goes prefill A,
    prefill B, decode A, prefill C, decode B, decode A, ... (prefills land between decodes)."""
    for k in reversed(range(len(runs))):
        if t >= k and not runs[k].done:
            runs[k].step()


def _check(runs: list[Driven], expect: list[list[int]]) -> None:
    for run, want in zip(runs, expect, strict=True):
        assert run.tokens == want
        for partial in run.before:  # what a stream made before it was reset matched too
            assert partial == want[: len(partial)]


def test_interleaved_streams_match_each_alone(setup: Setup) -> None:
    runs = [Driven(setup.pipe, p) for p in setup.prompts]
    t = 0
    while not all(r.done for r in runs):
        _tick(runs, t)
        t += 1
    for r in runs:
        r.close()
    _check(runs, setup.alone)


def test_reset_or_reopen_mid_way_leaves_other_streams_alone(setup: Setup) -> None:
    a, b, c = runs = [Driven(setup.pipe, p) for p in setup.prompts]
    # A 4th stream reset and then re-prefilled with *another* prompt must give that prompt's
    # tokens: nothing of its old cache may survive reset_state().
    d = Driven(setup.pipe, setup.prompts[2])
    runs.append(d)
    t = 0
    while not all(r.done for r in runs):
        if t == 9:
            b.reopen()
        if t == 13:
            c.reset()
        if t == 6:
            d.reset()
            d.prompt = setup.prompts[0]
        _tick(runs, t)
        t += 1
    assert [len(r.before) for r in runs] == [0, 1, 1, 1]
    for r in runs:
        r.close()
    _check([a, b, c], setup.alone)
    assert d.before[0] == setup.alone[2][: len(d.before[0])] and d.tokens == setup.alone[0]


@pytest.mark.parametrize("num_streams", [1, 2])
def test_streams_in_two_threads_on_the_same_compiled_models(
    num_streams: int, shards: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each thread drives its own streams on the one pipeline (same compiled stages); a barrier
    makes them step at the same moment. NUM_STREAMS=1 (the latency hint's default: one executor
    graph that the requests share) and 2 (a graph per executor stream, truly in parallel)."""
    base = RunConfig.ov_properties
    monkeypatch.setattr(RunConfig, "ov_properties", lambda self: base(self) | {"NUM_STREAMS": str(num_streams)})
    s = _setup(shards("gguf", stages=2), RunConfig(precision="exact"))
    assert all(st.compiled.get_property("NUM_STREAMS") == num_streams for st in s.pipe.stages)
    # Thread 1: A and C, C reset mid-way. Thread 2: B and a second A, B closed and reopened.
    # The same prompt in both threads at once must still give the same tokens.
    one = [Driven(s.pipe, s.prompts[0]), Driven(s.pipe, s.prompts[2])]
    two = [Driven(s.pipe, s.prompts[1]), Driven(s.pipe, s.prompts[0])]
    ticks = N + 16  # enough for a stream restarted at tick 11 to finish
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def drive(runs: list[Driven], event: int, action: Callable[[], None]) -> None:
        try:
            for t in range(ticks):
                barrier.wait(timeout=120)
                if t == event:
                    action()
                _tick(runs, t)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=drive, args=(one, 11, one[1].reset)),
               threading.Thread(target=drive, args=(two, 8, two[0].reopen))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    for r in one + two:
        r.close()
    assert all(r.done for r in one + two)
    _check(one, [s.alone[0], s.alone[2]])
    _check(two, [s.alone[1], s.alone[0]])
    # The test means something only if steps of the two threads did run at the same time.
    spans = [[sp for r in runs for sp in r.spans] for runs in (one, two)]
    overlapping = sum(a0 < b1 and b0 < a1 for a0, a1 in spans[0] for b0, b1 in spans[1])
    assert overlapping >= N // 2


def test_start_async_on_several_requests_at_once(shards: Callable[..., Path]) -> None:
    """One thread, three requests of one compiled 1-stage model started together with
    `start_async` and then waited: the plugin runs them on its own executor. One request is
    reset mid-way while the others are in flight."""
    folder = shards("gguf", stages=1)
    s = _setup(folder, RunConfig(precision="exact"))
    (stage,) = s.pipe.stages
    compiled: ov.CompiledModel = stage.compiled
    beam = np.zeros(1, dtype=np.int32)

    @dataclass
    class Raw:
        prompt: list[int]
        request: ov.InferRequest = field(default_factory=compiled.create_infer_request)
        book: KVBook = field(default_factory=KVBook)
        tokens: list[int] = field(default_factory=list)
        before: list[list[int]] = field(default_factory=list)

    runs = [Raw(p) for p in s.prompts]
    t = 0
    while not all(len(r.tokens) >= N for r in runs):
        if t == 10:  # reset while no request is in flight (a reset during infer is not allowed)
            runs[1].request.reset_state()
            runs[1].book.reset()
            runs[1].before.append(runs[1].tokens)
            runs[1].tokens = []
        live = [r for k, r in enumerate(runs) if t >= k and len(r.tokens) < N]  # staggered starts
        plans = []
        for r in live:
            plan = r.book.plan([r.tokens[-1]] if r.tokens else r.prompt)
            # share_inputs=False: the request keeps its own copy while it runs after this call.
            r.request.start_async({"input_ids": plan.input_ids, "attention_mask": plan.attention_mask,
                                   "position_ids": plan.position_ids, "beam_idx": beam,
                                   "logits_index": np.array([[plan.position_ids.shape[1] - 1]])},
                                  share_inputs=False)
            plans.append(plan)
        for r, plan in zip(live, plans, strict=True):
            r.request.wait()
            r.book.commit(plan)
            r.tokens.append(int(np.argmax(r.request.get_tensor("logits").data[0, -1])))
        t += 1
    for r, want in zip(runs, s.alone, strict=True):
        assert r.tokens == want
        for partial in r.before:
            assert partial == want[: len(partial)]
    assert len(runs[1].before) == 1
