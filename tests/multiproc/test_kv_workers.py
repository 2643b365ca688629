"""A stream's KV moving over worker links (protocol 6; slices since 7), with real worker processes on loopback
under mutual TLS, exact precision: prefilled on one pipeline, exported, imported under another
key into another pipeline (in process or over other workers, chain or star) and decoded there,
it gives the tokens of a run that never moved. Moves that cannot be done fail their Future with
a clear reason, leave the key closed wherever they opened it, and the pipeline serves on; a
worker that dies under a move fails it, not hangs it."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardline.cluster.keygen import keygen
from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.context import run_context
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.node import kv as node_kv
from shardline.node.worker import StageWorker
from shardline.pipeline.kv import KvSnapshot, join
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Pipeline, decode, export_kv, import_kv, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.pipeline.remote_kv import KvImport
from shardline.stage.cache import KVBook
from shardline.wire.link import Link, client_handshake
from shardline.wire.messages import PROTOCOL, Activations, Hello, KvDone, KvPart, KvPull, KvPush, Refuse, Role, Route
from shardline.wire.tls import Credentials
from tests.conftest import CHAT_PROMPTS
from tests.helpers import GREEDY, greedy_ours, ok
from tests.multiproc.procs import Proc, worker

EXACT = RunConfig(precision="exact")
N = 16  # greedy tokens decoded after the first
WAIT_S = 30.0  # every wait on a Future is bounded
rng = np.random.default_rng(13)


@pytest.fixture(scope="module")
def folder(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kv-tls") / "cluster"
    keygen(out, 3)
    return out


@pytest.fixture(scope="module")
def workers(folder: Path, cluster: Path) -> Iterator[list[Proc]]:
    """Worker A and worker B, each running stage 1."""
    ws = [worker(folder, "1", credentials=cluster / "node-1"), worker(folder, "1", credentials=cluster / "node-2")]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def local(folder: Path) -> Iterator[LocalPipeline]:
    with LocalPipeline(folder, EXACT) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def prompt(folder: Path) -> list[int]:
    return ChatTokenizer(folder).encode_chat([{"role": "user", "content": CHAT_PROMPTS[2]}])


@pytest.fixture(scope="module")
def plain(local: LocalPipeline, prompt: list[int]) -> list[int]:
    """The tokens of a run that never moved."""
    return greedy_ours(local, prompt, N + 1)[0]


def _remote(folder: Path, w: Proc, cluster: Path, topology: str = "chain") -> RemotePipeline:
    return RemotePipeline(folder, [w.addr], EXACT, "f32", topology, Credentials.load(cluster / "node-0"))


def _prefilled(pipe: Pipeline, key: int, prompt: list[int]) -> tuple[KvSnapshot, KVBook, int]:
    """`prompt` prefilled under `key` (left open): its exported KV, its book, its first token."""
    book = KVBook()
    (out,) = ok(run(pipe, prefill(key, book, prompt, GREEDY, first=True, last=True), timeout=WAIT_S))
    return export_kv(pipe, key).result(WAIT_S), book, out.choices[0].token


def _greedy(pipe: Pipeline, key: int, book: KVBook, first: int) -> list[int]:
    tokens = [first]
    for _ in range(N):
        (out,) = ok(run(pipe, decode(key, book, [tokens[-1]], GREEDY), timeout=WAIT_S))
        tokens.append(out.choices[0].token)
    pipe.release(key)
    return tokens


def _moved(source: Pipeline, target: Pipeline, prompt: list[int], keys: tuple[int, int]) -> list[int]:
    """Prefilled on `source`, decoded on `target` after the move (steps queued behind the import)."""
    snap, book, first = _prefilled(source, keys[0], prompt)
    source.release(keys[0])
    assert (snap.rows, snap.slots, len(snap.stages)) == (1, len(prompt), source.n_stages)
    landed = import_kv(target, keys[1], snap)
    tokens = _greedy(target, keys[1], book, first)
    landed.result(WAIT_S)
    return tokens


def _error(future: Future[Any]) -> str:
    with pytest.raises(ShardlineError) as caught:
        future.result(WAIT_S)
    return str(caught.value)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_remote_to_local(folder: Path, cluster: Path, workers: list[Proc], local: LocalPipeline, prompt: list[int],
                         plain: list[int], topology: str) -> None:
    remote = _remote(folder, workers[0], cluster, topology)
    try:
        assert _moved(remote, local, prompt, (1, 7)) == plain
        assert remote.stage0.keys() == []
    finally:
        remote.shutdown()


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_local_to_remote(folder: Path, cluster: Path, workers: list[Proc], local: LocalPipeline, prompt: list[int],
                         plain: list[int], topology: str) -> None:
    remote = _remote(folder, workers[1], cluster, topology)
    try:
        assert _moved(local, remote, prompt, (2, 8)) == plain
    finally:
        remote.shutdown()


def test_remote_to_remote(folder: Path, cluster: Path, workers: list[Proc], prompt: list[int],
                          plain: list[int]) -> None:
    a, b = _remote(folder, workers[0], cluster), _remote(folder, workers[1], cluster)
    try:
        assert _moved(a, b, prompt, (3, 3)) == plain  # the same key, another coordinator's session
        assert _moved(b, a, prompt, (4, 9)) == plain
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_slices_pulled_chunk_by_chunk_join_into_the_whole_cache(folder: Path, cluster: Path, workers: list[Proc],
                                                                prompt: list[int], topology: str) -> None:
    """Chunk-level transfer over the links: after each prefill chunk, the slots it added are
    pulled from stage 0 and the worker (KvPull's start); joined, they are the whole cache's
    export bit for bit. A start past the slots fails with the worker's reason."""
    remote = _remote(folder, workers[0], cluster, topology)
    try:
        book, slices, at = KVBook(), [], 0
        chunks = [prompt[i:i + 16] for i in range(0, len(prompt), 16)]
        for i, chunk in enumerate(chunks):
            remote.submit(prefill(21, book, chunk, GREEDY, first=i == 0, last=i == len(chunks) - 1))
            slices.append(export_kv(remote, 21, at))
            at = book.slots
        parts = [f.result(WAIT_S) for f in slices]
        assert [(x.start, x.slots) for x in parts] == [(16 * i, len(c)) for i, c in enumerate(chunks)]
        joined, whole = join(parts), export_kv(remote, 21).result(WAIT_S)
        for got, want in zip(joined.stages, whole.stages, strict=True):
            assert (got.first_layer, got.last_layer) == (want.first_layer, want.last_layer)
            assert all(np.array_equal(got.arrays[n], want.arrays[n]) for n in want.arrays)
        assert f"KV from slot {len(prompt) + 1} of key 21, which holds {len(prompt)}" in _error(
            export_kv(remote, 21, len(prompt) + 1))
        remote.release(21)
    finally:
        remote.shutdown()


def _shorter(snap: KvSnapshot) -> KvSnapshot:
    """`snap` with one of stage 1's variables a slot short (the original stays as it was)."""
    arrays = dict(snap.stages[1].arrays)
    name = sorted(arrays)[0]
    arrays[name] = arrays[name][:, :, 1:]
    return replace(snap, stages=(snap.stages[0], replace(snap.stages[1], arrays=arrays)))


def test_moves_that_cannot_be_done_fail_clearly_and_leave_nothing_open(
        folder: Path, cluster: Path, workers: list[Proc], local: LocalPipeline, prompt: list[int],
        plain: list[int]) -> None:
    remote = _remote(folder, workers[0], cluster)
    w = workers[0].addr
    try:
        assert "cannot export the KV of key 4: stage 0: unknown key 4 on stage0" in _error(export_kv(remote, 4))
        remote.stage0.open(5)  # open here alone (the stage-0 thread is idle): only the worker lacks it
        assert f"cannot export the KV of key 5: worker {w}: unknown key 5 on stage1" in _error(export_kv(remote, 5))
        remote.stage0.close(5)
        snap, book, first = _prefilled(local, 6, prompt)
        local.release(6)

        # Refused before any stage sees it: another layout, another export.
        assert "stage 1 state" in _error(import_kv(remote, 10, _shorter(snap)))
        assert "cannot go into export" in _error(import_kv(remote, 10, replace(snap, export="0" * 64 + "/gguf/None")))
        # Past the coordinator's check (as a coordinator of another layout would send it): the
        # worker refuses it, stage 0's copy is undone before the Future fails.
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        remote._inbox.put(KvImport(10, _shorter(snap), future))
        assert f"cannot import the KV of key 10: worker {w}: key 10: stage1 state" in _error(future)
        assert not remote.stage0.has(10)

        ok(run(remote, prefill(11, KVBook(), prompt[:8], GREEDY, first=True, last=True), timeout=WAIT_S))
        assert "stage 0: key 11 is already open on stage0" in _error(import_kv(remote, 11, snap))
        remote.stage0.close(11)  # now open on the worker alone: the worker refuses, stage 0 is undone
        assert f"worker {w}: key 11 is already open on stage1" in _error(import_kv(remote, 11, snap))
        assert not remote.stage0.has(11)
        remote.release(11)  # the worker's own key 11, which the refused import did not touch

        # The pipeline serves on, and the key imports once it is free everywhere.
        import_kv(remote, 11, snap).result(WAIT_S)
        assert _greedy(remote, 11, book, first) == plain
    finally:
        remote.shutdown()
    assert remote.stage0.keys() == []


def test_a_worker_killed_under_a_move_fails_it(folder: Path, cluster: Path, prompt: list[int]) -> None:
    with worker(folder, "1", credentials=cluster / "node-1") as w:
        remote = _remote(folder, w, cluster)
        try:
            book = KVBook()
            ok(run(remote, prefill(1, book, prompt, GREEDY, first=True, last=True), timeout=WAIT_S))
            os.kill(w.proc.pid, signal.SIGSTOP)  # hung: the pull waits on it
            pending = export_kv(remote, 1)
            time.sleep(0.5)
            assert not pending.done()
            w.proc.kill()
            assert "lost worker" in _error(pending)  # within WAIT_S: a reason, not a hang
        finally:
            remote.shutdown()


# --- a worker driven by hand: what a coordinator's KV messages can and cannot make it do ----------


@pytest.fixture(scope="module")
def inproc(folder: Path) -> Iterator[StageWorker]:
    """A worker in this process (in clear), to look at what its stages hold."""
    w = StageWorker(folder, 1, 1, EXACT)
    w.listen("127.0.0.1", 0)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            w.handle_next(0.1)

    loop = threading.Thread(target=serve, daemon=True)
    loop.start()
    yield w
    stop.set()
    loop.join(timeout=10)
    w.stop()


def _coordinator(w: StageWorker) -> Link:
    m = load_manifest(w.shard.folder)
    link = Link.connect("127.0.0.1", w.port, None, frame_timeout=WAIT_S, handshake_timeout=WAIT_S)
    client_handshake(link, Hello(PROTOCOL, Role.COORDINATOR, m.model_hash, 0, m.stages[1].first_layer - 1, m.weights,
                                 Activations.F32, secrets.token_hex(16), run_context(m.arch, None)), lambda _: None)
    link.send(Route(""))
    link._wait = WAIT_S  # every wait for an answer is bounded (a test's, not the worker's)
    return link


def _push(link: Link, seq: int, key: int, parts: list[KvPart], announced: int | None = None) -> KvDone:
    link.send(KvPush(seq, key, 1, 3, len(parts) if announced is None else announced))
    for part in parts:
        link.send(replace(part, seq=seq))
    done = link.recv()
    assert isinstance(done, KvDone) and done.seq == seq
    return done


def test_a_worker_checks_every_part_and_outlives_any(inproc: StageWorker) -> None:
    stage = inproc.stages[0]
    e, states = stage.entry, sorted(node_kv.states(stage).items())
    parts = [KvPart(1, e.first_layer, e.last_layer, name, rng.standard_normal((1, heads, 3, dim)).astype(dtype))
             for name, (dtype, heads, dim) in states]
    a, b = _coordinator(inproc), _coordinator(inproc)
    try:
        a.send(KvPull(1, 42))
        assert a.recv() == KvDone(1, 0, "unknown key 42 on stage1")
        assert "1 parts announced; this worker's stages hold" in _push(a, 2, 5, parts[:1]).error
        wrong = replace(parts[-1], state=parts[-1].state[:, :, :2])
        assert f"stage1 state {wrong.name} is float32 [1, " in _push(a, 3, 5, [*parts[:-1], wrong]).error
        other = replace(parts[0], first_layer=e.first_layer + 1)
        assert "a part of layers" in _push(a, 4, 5, [other, *parts[1:]]).error
        assert stage.keys() == []  # nothing opened by a push that did not fit

        assert _push(a, 5, 5, parts) == KvDone(5, len(parts), "")
        assert _push(b, 1, 5, parts) == KvDone(1, len(parts), "")  # b's own key 5: sessions never meet
        a.send(KvPull(6, 5))
        got = [a.recv() for _ in parts]
        assert a.recv() == KvDone(6, len(parts), "")
        assert all(isinstance(g, KvPart) and np.array_equal(g.state, p.state) for g, p in zip(got, parts, strict=True))
        assert "key 5 is already open on stage1" in _push(a, 7, 5, parts).error

        a.send(KvPart(8, e.first_layer, e.last_layer, parts[0].name, parts[0].state))  # of no push
        assert a.recv() == Refuse("KvPart 8 out of order: no KV push is under way")
        b.send(KvPull(2, 5))  # the other session goes on, with its own key 5
        assert [type(b.recv()) for _ in range(len(parts) + 1)] == [KvPart] * len(parts) + [KvDone]
    finally:
        a.close()
        b.close()
    deadline = time.monotonic() + 10
    while stage.keys() and time.monotonic() < deadline:  # both sessions ended: all freed
        time.sleep(0.05)
    assert stage.keys() == []


def test_three_stages_over_two_workers_and_over_one_running_two(shards: Callable[..., Path], cluster: Path,
                                                                 prompt: list[int]) -> None:
    """A daisy chain of two workers (a step after an import reaches the second worker through
    the first, so it waits for the import to land there), and a worker running stages 1-2 (the
    coordinator cannot tell which stages it runs: it sends it all, the worker keeps its own)."""
    three = shards("fp32", stages=3)
    with LocalPipeline(three, EXACT) as local:
        want = greedy_ours(local, prompt, N + 1)[0]
    creds = Credentials.load(cluster / "node-0")
    with worker(three, "1", credentials=cluster / "node-1") as w1, worker(three, "2", credentials=cluster / "node-2") \
            as w2, worker(three, "1-2", credentials=cluster / "node-1") as both:
        chain = RemotePipeline(three, [w1.addr, w2.addr], EXACT, "f32", "chain", creds)
        one = RemotePipeline(three, [both.addr], EXACT, "f32", "chain", creds)
        try:
            assert _moved(chain, one, prompt, (1, 2)) == want
            assert _moved(one, chain, prompt, (3, 4)) == want
        finally:
            chain.shutdown()
            one.shutdown()
