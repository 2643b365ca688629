"""Mutual TLS between real processes on loopback: a chain under TLS gives the in-process tokens;
a peer in clear or with another cluster's credentials is refused during the TLS handshake (and
the worker logs its address); bytes tapped on a link show the prompt's traces in clear and none
under TLS."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shardline.cluster.keygen import keygen
from shardline.config import RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.wire.codec import HEADER, decode_payload, parse_header
from shardline.wire.messages import Forward, Sampled
from shardline.wire.tls import Credentials
from tests.conftest import CHAT_PROMPTS
from tests.helpers import engine_tokens
from tests.multiproc.procs import Proc, worker

N_NEW = 12
CFG = SamplingConfig(max_tokens=N_NEW)


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tls") / "cluster"
    keygen(out, 2)
    return out


@pytest.fixture(scope="module")
def prompt(two: Path) -> list[int]:
    return ChatTokenizer(two).encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])


@pytest.fixture(scope="module")
def local_tokens(two: Path, prompt: list[int]) -> list[int]:
    with LocalPipeline(two, RunConfig()) as pipe:
        return engine_tokens(pipe, prompt, CFG)


@pytest.fixture(scope="module")
def tls_worker(two: Path, cluster: Path) -> Iterator[Proc]:
    with worker(two, "1", credentials=cluster / "node-1") as w:
        yield w


class Tap:
    """A TCP forwarder on loopback that keeps every byte it passes, per direction."""

    def __init__(self, to: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.to = to
        self.sent, self.answered = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        self.server.settimeout(60)
        a, _ = self.server.accept()
        b = socket.create_connection(("127.0.0.1", self.to), timeout=60)
        pumps = [threading.Thread(target=self._pump, args=(a, b, self.sent), daemon=True),
                 threading.Thread(target=self._pump, args=(b, a, self.answered), daemon=True)]
        for t in pumps:
            t.start()
        self._threads += pumps

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, kept: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                kept += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()
        for t in self._threads[1:]:
            t.join(timeout=30)


def _through_tap(folder: Path, port: int, prompt: list[int], creds: Credentials | None) -> tuple[list[int], Tap]:
    tap = Tap(port)
    pipe = RemotePipeline(folder, [f"127.0.0.1:{tap.port}"], RunConfig(), credentials=creds)
    try:
        return engine_tokens(pipe, prompt, CFG), tap
    finally:
        pipe.shutdown()
        tap.close()


def _frames(stream: bytes) -> list[object]:
    out, at = [], 0
    while at + HEADER.size <= len(stream):
        kind, length, crc = parse_header(stream[at: at + HEADER.size])
        at += HEADER.size
        out.append(decode_payload(kind, stream[at: at + length], crc))
        at += length
    return out


def test_a_chain_under_tls_gives_the_local_tokens(two: Path, cluster: Path, tls_worker: Proc, prompt: list[int],
                                                   local_tokens: list[int]) -> None:
    pipe = RemotePipeline(two, [tls_worker.addr], RunConfig(), credentials=Credentials.load(cluster / "node-0"))
    try:
        assert engine_tokens(pipe, prompt, CFG) == local_tokens
    finally:
        pipe.shutdown()


def test_peers_without_this_clusters_credentials_are_refused(two: Path, tls_worker: Proc,
                                                             tmp_path: Path) -> None:
    with pytest.raises(ShardlineError, match=f"worker {tls_worker.addr}: .*closed the connection"):
        RemotePipeline(two, [tls_worker.addr], RunConfig(), credentials=None)  # in clear
    keygen(tmp_path / "other", 1)
    stranger = Credentials.load(tmp_path / "other" / "node-0")
    with pytest.raises(ShardlineError, match=f"worker {tls_worker.addr} refused this node's credentials"):
        RemotePipeline(two, [tls_worker.addr], RunConfig(), credentials=stranger)
    log = tls_worker.wait_for_stderr("certificate verify failed")
    refusals = [line for line in log.splitlines() if "TLS handshake failed" in line]
    assert len(refusals) == 2 and all("refused 127.0.0.1:" in line for line in refusals), log
    assert "WRONG_VERSION_NUMBER" in refusals[0] or "wrong version number" in refusals[0], refusals[0]


def test_a_tapped_link_shows_nothing_under_tls(two: Path, cluster: Path, tls_worker: Proc, prompt: list[int],
                                               local_tokens: list[int]) -> None:
    model_hash = load_manifest(two).model_hash.encode()
    with worker(two, "1") as clear_worker:  # the control: the same request in clear
        got, tap = _through_tap(two, clear_worker.port, prompt, None)
    assert got == local_tokens
    sent = _frames(bytes(tap.sent))
    hidden = next(m.hidden for m in sent if isinstance(m, Forward))
    chosen = np.concatenate([m.tokens for m in _frames(bytes(tap.answered)) if isinstance(m, Sampled)])
    # the model's hash (in the Hello), 64 bytes of the first hidden states, the last token chosen
    traces = [model_hash, hidden.tobytes()[1000:1064], chosen[-1:].astype(np.int64).tobytes()]
    found = [t in tap.sent or t in tap.answered for t in traces]
    assert found == [True, True, True]  # the detector finds each of them in clear

    got, tap = _through_tap(two, tls_worker.port, prompt, Credentials.load(cluster / "node-0"))
    assert got == local_tokens
    assert len(tap.sent) > hidden.nbytes  # the hidden states did pass, encrypted
    assert not any(t in tap.sent or t in tap.answered for t in traces)
