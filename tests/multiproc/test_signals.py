"""`shardline relay`, `worker` and `serve` stop on SIGINT (exit 130) and SIGTERM (exit 143) within
seconds and without a traceback, with a connection open, whether they were started with those
signals at their defaults or ignored (as a shell's background job or a supervisor may start them).
For `serve` the exit code also shows the engine was stopped: SIGTERM used to kill it the moment
uvicorn re-raised the signal, before the `finally` that stops the engine."""

from __future__ import annotations

import http.client
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from tests.multiproc.procs import STOP_SIGNALS, Proc, relay, serve, worker

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
STOP_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@contextmanager
def _relay(folder: Path, ignore: tuple[signal.Signals, ...]) -> Iterator[Proc]:
    """A relay with one connection open through it to a listening socket."""
    with socket.create_server(("127.0.0.1", 0)) as target, \
            relay(f"127.0.0.1:{target.getsockname()[1]}", 5, ignore) as r, \
            socket.create_connection(("127.0.0.1", r.port), timeout=10) as client:
        target.settimeout(10)
        with target.accept()[0]:
            client.sendall(b"x" * 1000)
            yield r


@contextmanager
def _worker(folder: Path, ignore: tuple[signal.Signals, ...]) -> Iterator[Proc]:
    """A worker holding stage 1, with a connection open that has not said Hello yet (its reader
    thread waits on it) while the main thread waits for work."""
    with worker(folder, "1", ignore=ignore) as w, socket.create_connection(("127.0.0.1", w.port), timeout=10):
        yield w


@contextmanager
def _serve(folder: Path, ignore: tuple[signal.Signals, ...]) -> Iterator[Proc]:
    """A server that has answered one request on a connection it keeps alive."""
    with serve(["--shards", str(folder), "--port", "0"], ignore) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            yield s
        finally:
            conn.close()


STARTS: dict[str, Callable[[Path, tuple[signal.Signals, ...]], AbstractContextManager[Proc]]] = {
    "relay": _relay, "worker": _worker, "serve": _serve}


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("command", STARTS)
def test_stops_quietly_on_signal(two: Path, command: str, sig: signal.Signals, inherited: str) -> None:
    with STARTS[command](two, STOP_SIGNALS if inherited == "ignored" else ()) as p:
        p.proc.send_signal(sig)
        assert p.proc.wait(timeout=STOP_TIMEOUT_S) == EXIT_CODES[sig], p.stderr()
        err = p.stderr()
    assert "Traceback" not in err and "Error" not in err, err
    if command != "worker":  # a worker logs what it loads at INFO; the others say nothing at all
        assert [line for line in err.splitlines() if not line.startswith("serving ")] == [], err
