"""Per-token breakdown and full logits, between real processes on loopback.

Every token reports each stage's graph time, codec, host and wire time; the parts add up to
the coordinator's round trip as measured from outside; a delay added on every hop shows up
in the wire's share and nowhere else; the figures reach the Prometheus registry. Full logits
travel only for a stream that asks for them, and then equal the in-process logits.
"""

from __future__ import annotations

import ast
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from shardline.config import RunConfig, SamplingParams
from shardline.decoding.sampler import Choice
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome, Step, decode, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.pipeline.timing import Timing
from shardline.stage.cache import KVBook
from tests.helpers import GREEDY, ok
from tests.multiproc.procs import SHARDLINE, Proc, relay, workers_of

N_STEPS = 10


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Proc]]:
    with workers_of(three, "1", "2") as ws:
        yield ws


def _prompt(folder: Path) -> list[int]:
    return ChatTokenizer(folder).encode_chat([{"role": "user", "content": "Why is the sea salty?"}])


def _steps(remote: RemotePipeline, prompt: list[int], n: int) -> list[tuple[Outcome, float]]:
    """n greedy steps through submit/outcomes, each with its round trip as timed from outside
    (from the step's submission: its plan is made before)."""
    book, got = KVBook(), []
    step: Step = prefill(1, book, prompt, GREEDY, first=True, last=True)
    for _ in range(n):
        start = time.perf_counter()
        (outcome,) = ok(run(remote, step))
        got.append((outcome, time.perf_counter() - start))
        step = decode(1, book, [outcome.choices[0].token], GREEDY)
    remote.release(1)
    return got


def _count(stage: str) -> float:
    return REGISTRY.get_sample_value("shardline_stage_graph_seconds_count", {"stage": stage, "phase": "decode"}) or 0


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_every_stage_is_reported_and_the_parts_add_up_to_the_round_trip(
        three: Path, workers: list[Proc], topology: str) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", topology)
    before = _count("2")
    got = _steps(remote, _prompt(three), N_STEPS)
    remote.shutdown()
    timings = [o.timing for o, _ in got]
    assert all(t is not None for t in timings)
    assert [t.phase for t in timings if t] == ["prefill"] + ["decode"] * (N_STEPS - 1)
    for t, (_, outside) in zip(timings, got, strict=True):
        assert t is not None
        assert set(t.graph_s) == {0, 1, 2} and min(t.graph_s.values()) > 0
        assert t.encode_s > 0 and t.decode_s > 0 and t.worker_host_s > 0 and t.coordinator_host_s > 0
        assert t.wire_s >= 0
        assert sum(t.parts().values()) == pytest.approx(t.total_s)
        assert t.total_s <= outside
    # What the coordinator calls the round trip is what its caller waits, bar a thread wake-up.
    assert statistics.median(outside - t.total_s for t, (_, outside) in zip(timings, got, strict=True) if t) < 0.002
    assert _count("2") - before == N_STEPS - 1  # exported as metrics too


def test_a_delay_on_every_hop_is_wire_time_and_nothing_else(three: Path, workers: list[Proc]) -> None:
    """Coordinator -> relay -> worker 1 -> relay -> worker 2 -> relay -> coordinator: 3 x 20 ms."""
    quick = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32")
    direct = [o.timing for o, _ in _steps(quick, _prompt(three), N_STEPS)[1:]]
    quick.shutdown()
    relays = [relay(w.addr, 20) for w in workers]
    try:
        slow = RemotePipeline(three, [r.addr for r in relays], RunConfig(), "f32")
        delayed = [o.timing for o, _ in _steps(slow, _prompt(three), N_STEPS)[1:]]
        slow.shutdown()
    finally:
        for r in relays:
            r.stop()

    def median(ts: list[Timing | None], part: Callable[[Timing], float]) -> float:
        return statistics.median(part(t) for t in ts if t)

    # Each crossing of a relay takes at least its delay; what the relays add beyond it (their own
    # wake-ups) is wire time too. Graph time is not compared: on a shared machine it varies more
    # than this between two runs, and it is measured around the infer call alone anyway.
    assert median(delayed, lambda t: t.wire_s) >= 0.060
    assert median(delayed, lambda t: t.wire_s) - median(direct, lambda t: t.wire_s) < 0.080
    for part in (lambda t: t.worker_host_s, lambda t: t.coordinator_host_s, lambda t: t.encode_s + t.decode_s):
        assert abs(median(delayed, part) - median(direct, part)) < 0.003  # none of the delay lands here


def _advance_all(pipe: LocalPipeline | RemotePipeline, prompt: list[int], n: int, want_logits: bool = False,
                 top: int = 0) -> list[Choice]:
    params = SamplingParams(top_logprobs=top)
    book, choices = KVBook(), []
    step: Step = prefill(1, book, prompt, params, first=True, last=True, want_logits=want_logits)
    for _ in range(n):
        (outcome,) = ok(run(pipe, step))
        choices.append(outcome.choices[0])
        step = decode(1, book, [choices[-1].token], params, want_logits=want_logits)
    pipe.release(1)
    return choices


def test_full_logits_travel_only_on_request_and_equal_the_in_process_logits(
        three: Path, workers: list[Proc]) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32")
    prompt, last = _prompt(three), remote.links[-1]

    before = last.bytes_received
    plain = _advance_all(remote, prompt, 6)
    top1_bytes = (last.bytes_received - before) / len(plain)
    assert all(c.logits is None for c in plain)

    before = last.bytes_received
    full = _advance_all(remote, prompt, 6, want_logits=True)
    full_bytes = (last.bytes_received - before) / len(full)
    before = last.bytes_received
    tops = _advance_all(remote, prompt, 6, top=5)
    top5_bytes = (last.bytes_received - before) / len(tops)
    remote.shutdown()

    vocab = full[0].logits.shape[0] if full[0].logits is not None else 0
    assert top1_bytes < 300  # token, logprob, the hops: no logits
    assert top5_bytes < top1_bytes + 5 * 12 + 64  # five ids and logprobs more, not the logits
    assert full_bytes > 4 * vocab
    with LocalPipeline(three, RunConfig()) as pipe:
        local = _advance_all(pipe, prompt, 6, want_logits=True)
    assert [c.token for c in full] == [c.token for c in local] == [c.token for c in plain]
    for r, ref in zip(full, local, strict=True):
        assert r.logits is not None and ref.logits is not None
        np.testing.assert_allclose(r.logits, ref.logits, atol=1e-4, rtol=0)
        assert r.logprob == pytest.approx(ref.logprob, abs=1e-5)
    for t, ref in zip(tops, local, strict=True):  # the top 5 the last worker computed
        assert ref.logits is not None and len(t.top) == 5
        order = np.argsort(-ref.logits)[:5].tolist()
        assert [i for i, _ in t.top] == order and t.top[0] == (t.token, pytest.approx(t.logprob, abs=1e-6))


def test_generate_prints_top_logprobs_to_stderr(three: Path, workers: list[Proc]) -> None:
    run = subprocess.run([SHARDLINE, "generate", "What is the capital of France?", "--shards", str(three),
                          "--workers", ",".join(w.addr for w in workers), "--max-tokens", "4", "--logprobs", "3",
                          "--insecure"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    entry = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""  # a token's text as Python repr shows it
    logprob = r"-?\d+\.\d{4}"
    line = re.compile(rf"^({entry}) ({logprob}) \| top: ({entry}) ({logprob})(, ({entry}) {logprob}){{2}}$")
    warning, *lines = run.stderr.strip().splitlines()
    assert warning.startswith("shardline: warning: --insecure") and len(lines) == 4
    texts = []
    for text in lines:
        m = line.match(text)
        assert m, text
        assert (m.group(1), m.group(2)) == (m.group(3), m.group(4))  # greedy: the token is the most likely
        texts.append(ast.literal_eval(m.group(1)))
    assert run.stdout == "".join(texts) + "\n" == "The capital of France\n"
