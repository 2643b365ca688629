"""Real worker processes on loopback: the in-process tokens (whole and chunked prompts, sampled,
multi-token steps, decode groups), handshake refusals, garbage, two coordinators sharing the
workers, a coordinator that leaves, and a worker killed and restarted."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer
from shardline.node.worker import StageWorker
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Pipeline, decode, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Request
from shardline.serving.scheduler import SchedulerConfig
from shardline.stage.cache import KVBook
from tests.conftest import CHAT_PROMPTS
from tests.helpers import GREEDY, engine_tokens, greedy_ours, ok, staggered
from tests.multiproc.procs import Proc, worker, workers_of

N_NEW = 24


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Proc]]:
    with workers_of(three, "1", "2") as ws:
        yield ws


@pytest.fixture(scope="module")
def local(three: Path) -> Iterator[LocalPipeline]:
    with LocalPipeline(three, RunConfig()) as pipe:
        yield pipe


def _run(pipe: Pipeline, prompt: list[int], cfg: SamplingConfig, chunk: int = 256) -> list[int]:
    return engine_tokens(pipe, prompt, cfg, chunk)


def _prompts(folder: Path) -> list[list[int]]:
    tok = ChatTokenizer(folder)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT_PROMPTS[:3]]


def _remote(three: Path, workers: list[Proc], topology: str = "chain") -> RemotePipeline:
    return RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", topology)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_workers_give_the_in_process_tokens(three: Path, workers: list[Proc], local: LocalPipeline,
                                            topology: str) -> None:
    remote = _remote(three, workers, topology=topology)
    greedy = SamplingConfig(max_tokens=N_NEW)
    sampled = SamplingConfig(max_tokens=N_NEW, temperature=0.8, top_p=0.9, top_k=40, seed=11)
    try:
        for prompt in _prompts(three):
            want = _run(local, prompt, greedy)
            assert _run(remote, prompt, greedy) == want
            assert _run(remote, prompt, greedy, chunk=7) == want  # chunked through the workers
            assert _run(remote, prompt, sampled) == _run(local, prompt, sampled)
    finally:
        remote.shutdown()


def test_k_known_tokens_in_one_step_through_workers(three: Path, workers: list[Proc], local: LocalPipeline) -> None:
    remote = _remote(three, workers)
    try:
        for prompt in _prompts(three)[:2]:
            greedy = greedy_ours(local, prompt, 9)[0]
            book = KVBook()
            ok(run(remote, prefill(1, book, prompt, GREEDY, first=True, last=True)))
            (out,) = ok(run(remote, decode(1, book, greedy[:8], GREEDY, sample_all=True)))
            remote.release(1)
            assert [c.token for c in out.choices] == greedy[1:9]
    finally:
        remote.shutdown()


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_decode_groups_through_workers_equal_alone(three: Path, workers: list[Proc], local: LocalPipeline,
                                                   topology: str) -> None:
    # Streams join a group at different steps (their KV merged on every worker) and leave at
    # different steps (dropped by the kept rows); 2-row groups overflow into a second group.
    prompts = _prompts(three)[:3] + _prompts(three)[:2]
    lengths = [20, 24, 5, 12, 7]  # the first two still run when the third joins: 2-row groups overflow
    alone = [greedy_ours(local, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    remote = _remote(three, workers, topology=topology)
    # fixed chunks (pacing=None): paced, the third prompt may be prefilled after the first two
    # ended, and no group would overflow; this test is about the groups' KV on the workers
    engine = Engine(remote, Limits(8, 8), 8192, SchedulerConfig(groups=1, max_rows=2, chunk=16, pacing=None))
    try:
        assert staggered(engine, prompts, lengths) == alone
        assert len(engine.scheduler.groups) > 1 and all(not g.members() for g in engine.scheduler.groups)
    finally:
        engine.stop()
        remote.shutdown()
    assert remote.stage0.keys() == []  # every row's KV freed here (and Release sent on)


def test_f16_activations_answer_the_same_question(three: Path, workers: list[Proc]) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig())
    tok = ChatTokenizer(three)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    try:
        assert "Paris" in tok.decode(_run(remote, prompt, SamplingConfig(max_tokens=12)))
    finally:
        remote.shutdown()


def test_two_coordinators_share_the_workers(three: Path, workers: list[Proc], local: LocalPipeline) -> None:
    """Each coordinator is its own session on the workers: their streams (with the same keys,
    at the same time) never meet, and each gets its own answers."""
    prompts = _prompts(three)
    want = [_run(local, p, SamplingConfig(max_tokens=N_NEW)) for p in prompts[:2]]
    got: list[list[int]] = [[], []]

    def drive(i: int) -> None:
        remote = _remote(three, workers)
        try:
            for _ in range(2):
                got[i] = _run(remote, prompts[i], SamplingConfig(max_tokens=N_NEW))
        finally:
            remote.shutdown()

    threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want


def test_a_coordinator_that_leaves_frees_its_streams(three: Path, shards: Callable[..., Path]) -> None:
    """In-process workers on real sockets, to look at what they hold."""
    w1, w2 = StageWorker(three, 1, 1), StageWorker(three, 2, 2)
    for w in (w1, w2):
        w.listen("127.0.0.1", 0)
        threading.Thread(target=w.serve_forever, daemon=True).start()
    remote = RemotePipeline(three, [f"127.0.0.1:{w1.port}", f"127.0.0.1:{w2.port}"], RunConfig(), "f32")
    try:
        for key, prompt in enumerate(_prompts(three)):
            ok(run(remote, prefill(key, KVBook(), prompt, GREEDY, first=True, last=True)))
        assert len(w1.stages[0].keys()) == len(w2.stages[0].keys()) == 3 and len(w1.sessions) == 1
    finally:
        remote.shutdown()  # closes its links without a word: the workers must notice
    deadline = time.monotonic() + 10
    while (w1.stages[0].keys() or w2.stages[0].keys() or w1.sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w1.stages[0].keys() == w2.stages[0].keys() == [] and not w1.sessions and not w2.sessions
    w1.stop()
    w2.stop()


def test_out_of_order_workers_are_refused(three: Path, workers: list[Proc]) -> None:
    with pytest.raises(ShardlineError, match=r"worker 127.0.0.1:\d+: layer order: the coordinator's chain ends "
                                             r"at layer 9, but this worker serves layers 20-29"):
        RemotePipeline(three, [workers[1].addr, workers[0].addr])


def test_mismatched_shard_is_refused_naming_both_sides(shards: Callable[..., Path], workers: list[Proc]) -> None:
    other = shards("gguf", stages=3)  # same model, other weights
    with pytest.raises(ShardlineError, match="precision mismatch: worker has fp32 weights, coordinator has gguf"):
        RemotePipeline(other, [workers[0].addr, workers[1].addr])


def test_a_coordinator_and_workers_serving_other_contexts_are_refused(three: Path, workers: list[Proc]) -> None:
    """Workers at the model's default context (8192), a coordinator asked for 4096: refused on
    connecting, not halfway through a long stream."""
    with pytest.raises(ShardlineError, match=r"worker 127.0.0.1:\d+: context mismatch: worker serves 8192 tokens, "
                                             r"coordinator 4096 \(give them the same --context\)"):
        RemotePipeline(three, [workers[0].addr, workers[1].addr], RunConfig(context=4096))


def test_workers_started_with_a_context_serve_a_coordinator_of_the_same(three: Path) -> None:
    """`worker --context 64`: a coordinator of another context is refused, one of the same is
    served; a prompt past it is refused before any stage runs it."""
    ws = [worker(three, "1", extra=["--context", "64"]), worker(three, "2", extra=["--context", "64"])]
    try:
        with pytest.raises(ShardlineError, match="context mismatch: worker serves 64 tokens, coordinator 8192"):
            RemotePipeline(three, [w.addr for w in ws])
        remote = RemotePipeline(three, [w.addr for w in ws], RunConfig(context=64))
        try:
            prompt = _prompts(three)[0][:30]
            engine = Engine(remote, Limits(1, 0), remote.context)
            try:
                with pytest.raises(ShardlineError, match="prompt of 30 tokens plus 40 new tokens exceeds the "
                                                         "context of 64"):
                    engine.submit(Request(prompt, SamplingConfig(max_tokens=40), frozenset()), lambda _: None)
            finally:
                engine.stop()
            with LocalPipeline(three, RunConfig(context=64)) as local:
                assert _run(remote, prompt, SamplingConfig(max_tokens=8)) == _run(local, prompt,
                                                                                  SamplingConfig(max_tokens=8))
        finally:
            remote.shutdown()
    finally:
        for w in ws:
            w.stop()


def test_garbage_on_one_connection_does_not_stop_the_worker(three: Path, workers: list[Proc],
                                                           local: LocalPipeline) -> None:
    remote = _remote(three, workers)
    host, port = workers[0].addr.split(":")
    with socket.create_connection((host, int(port))) as junk:
        junk.sendall(b"\x00garbage that is not a frame\xff" * 10)
        time.sleep(0.2)
    prompt = _prompts(three)[0]
    try:
        assert _run(remote, prompt, SamplingConfig(max_tokens=8)) == _run(local, prompt, SamplingConfig(max_tokens=8))
    finally:
        remote.shutdown()


def test_killed_and_restarted_worker_is_reconnected(three: Path) -> None:
    first, last = worker(three, "1"), worker(three, "2")
    try:
        remote = _remote(three, [first, last])
        prompt = _prompts(three)[1]
        before = _run(remote, prompt, SamplingConfig(max_tokens=8))
        port = last.port
        last.stop()
        last = worker(three, "2", port=port)
        assert _run(remote, prompt, SamplingConfig(max_tokens=8)) == before
        remote.shutdown()
    finally:
        first.stop()
        last.stop()


def test_worker_dying_mid_stream_fails_the_step_not_hangs(three: Path) -> None:
    first, last = worker(three, "1"), worker(three, "2")
    try:
        remote = _remote(three, [first, last])
        book = KVBook()
        (out,) = ok(run(remote, prefill(1, book, _prompts(three)[0], GREEDY, first=True, last=True)))
        last.stop()
        (failed,) = run(remote, decode(1, book, [out.choices[0].token], GREEDY), timeout=60)
        assert failed.failed and ("lost worker" in failed.error or "lost the next worker" in failed.error)
        assert failed.lost  # the chain broke under it: the engine replays such a step's streams
        remote.shutdown()
    finally:
        first.stop()
        last.stop()
