"""Real worker processes on loopback: same tokens as in-process, handshake refusals, garbage,
and a worker killed and restarted between two requests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.generate import generate
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.stage.cache import Decode, Prefill
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours, staggered

SHARDLINE = str(Path(sys.executable).parent / "shardline")
N_NEW = 24


class Worker:
    def __init__(self, folder: Path, stage: str, port: int = 0) -> None:
        self.proc = subprocess.Popen(
            [SHARDLINE, "worker", "--shards", str(folder), "--stage", stage, "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening on 127.0.0.1:PORT" once the stage is compiled
        assert line.startswith("listening on "), line
        self.addr = line.split()[-1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Worker]]:
    ws = [Worker(three, "1"), Worker(three, "2")]
    yield ws
    for w in ws:
        w.stop()


def _run(pipe: LocalPipeline | RemotePipeline, prompt: list[int], cfg: SamplingConfig) -> list[int]:
    return list(generate(pipe, prompt, cfg, set(), 8192))


def _prompts(folder: Path) -> list[list[int]]:
    tok = ChatTokenizer(folder)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT_PROMPTS[:3]]


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_workers_give_the_in_process_tokens(three: Path, workers: list[Worker], topology: str) -> None:
    local = LocalPipeline(three, RunConfig())
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), activations="f32", topology=topology)
    greedy = SamplingConfig(max_tokens=N_NEW)
    sampled = SamplingConfig(max_tokens=N_NEW, temperature=0.8, top_p=0.9, top_k=40, seed=11)
    for prompt in _prompts(three):
        assert _run(remote, prompt, greedy) == _run(local, prompt, greedy)
        assert _run(remote, prompt, sampled) == _run(local, prompt, sampled)
    remote.shutdown()


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_decode_groups_through_workers_equal_alone(three: Path, workers: list[Worker], topology: str) -> None:
    # Streams join a group at different steps (their KV merged on every worker) and leave at
    # different steps (dropped by beam_idx); 2-row groups overflow into a second group.
    prompts = _prompts(three)[:3] + _prompts(three)[:2]
    lengths = [10, 14, 5, 12, 7]
    local = LocalPipeline(three, RunConfig())
    alone = [greedy_ours(local, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), activations="f32", topology=topology,
                            groups=1, group_rows=2)
    try:
        assert staggered(remote, prompts, lengths) == alone
        assert len(remote.groups) > 1 and all(not g.members() for g in remote.groups)
        assert remote.stage0._streams == {}  # every row's KV freed here (and CloseStream sent on)
    finally:
        remote.shutdown()


def test_f16_activations_answer_the_same_question(three: Path, workers: list[Worker]) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig())
    tok = ChatTokenizer(three)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in tok.decode(_run(remote, prompt, SamplingConfig(max_tokens=12)))
    remote.shutdown()


def test_out_of_order_workers_are_refused(three: Path, workers: list[Worker]) -> None:
    with pytest.raises(ShardlineError, match=r"worker 127.0.0.1:\d+: layer order: the coordinator's chain ends "
                                             r"at layer 9, but this worker serves layers 20-29"):
        RemotePipeline(three, [workers[1].addr, workers[0].addr])


def test_mismatched_shard_is_refused_naming_both_sides(shards: Callable[..., Path], workers: list[Worker]) -> None:
    other = shards("gguf", stages=3)  # same model, other weights
    with pytest.raises(ShardlineError, match="precision mismatch: worker has fp32 weights, coordinator has gguf"):
        RemotePipeline(other, [workers[0].addr, workers[1].addr])


def test_garbage_on_one_connection_does_not_stop_the_worker(three: Path, workers: list[Worker]) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), activations="f32")
    host, port = workers[0].addr.split(":")
    with socket.create_connection((host, int(port))) as junk:
        junk.sendall(b"\x00garbage that is not a frame\xff" * 10)
        time.sleep(0.2)
    prompt = _prompts(three)[0]
    assert _run(remote, prompt, SamplingConfig(max_tokens=8)) == _run(LocalPipeline(three), prompt,
                                                                        SamplingConfig(max_tokens=8))
    remote.shutdown()


def test_killed_and_restarted_worker_is_reconnected(three: Path) -> None:
    first, last = Worker(three, "1"), Worker(three, "2")
    try:
        remote = RemotePipeline(three, [first.addr, last.addr], RunConfig(), activations="f32")
        prompt = _prompts(three)[1]
        before = _run(remote, prompt, SamplingConfig(max_tokens=8))
        port = int(last.addr.split(":")[1])
        last.stop()
        last = Worker(three, "2", port=port)
        assert _run(remote, prompt, SamplingConfig(max_tokens=8)) == before
        remote.shutdown()
    finally:
        first.stop()
        last.stop()


def test_worker_dying_mid_stream_fails_the_step_not_hangs(three: Path) -> None:
    first, last = Worker(three, "1"), Worker(three, "2")
    try:
        remote = RemotePipeline(three, [first.addr, last.addr], RunConfig(), activations="f32")
        stream = remote.open(SamplingConfig())
        token = remote.advance(stream, Prefill(_prompts(three)[0])).token
        last.stop()
        with ThreadPoolExecutor(1) as pool, pytest.raises(ShardlineError, match=r"lost (worker|the next worker)"):
            pool.submit(remote.advance, stream, Decode(token)).result(timeout=60)
        remote.shutdown()
    finally:
        first.stop()
        last.stop()
