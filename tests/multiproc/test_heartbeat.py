"""Heartbeats through real processes (issue 36, points 2 and 3): `shardline serve` over two
`shardline worker`s at the default heartbeat. Each worker in turn is stopped (SIGSTOP) while the
chain is idle: /health turns 503 within the heartbeat window naming that stage and its address
(not its neighbour). A request that arrives meanwhile is never sent into the hung chain: it
waits for the repair within the reconnect window and is answered if the worker comes back in
time (the second one), else gets a 503 with Retry-After (the first one). Once the worker is
continued, /health is 200 within seconds and requests are answered. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from shardline.config import RecoveryConfig
from tests.multiproc.procs import Proc, serve, worker
from tests.multiproc.test_health import _answer, _health

HEARTBEAT_S = RecoveryConfig().heartbeat_s  # the default: what a user gets
POLL_S = 0.1
WINDOW_S = 4


def _chat(server: Proc, model: str) -> httpx.Response:
    return httpx.post(server.addr + "/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}]})


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


def _within(server: Proc, code: int, seconds: float) -> tuple[float, dict[str, Any]]:
    """How long until /health answers `code` (failing past `seconds`), and its body."""
    start = time.monotonic()
    while (got := _health(server))[0] != code:
        assert time.monotonic() - start < seconds, f"/health still {got} after {seconds:g} s"
        time.sleep(POLL_S)
    return time.monotonic() - start, got[1]


def test_a_stopped_idle_worker_is_seen_within_the_heartbeat_and_named(three: Path) -> None:
    w1, w2 = worker(three, "1"), worker(three, "2")
    try:
        with serve(["--shards", str(three), "--workers", f"{w1.addr},{w2.addr}", "--port", "0", "--insecure",
                    "--reconnect-window", str(WINDOW_S)]) as server:
            model = _within(server, 200, 40)[1]["model"]
            assert _answer(server)
            for stage, w in ((1, w1), (2, w2)):
                time.sleep(1.5 * HEARTBEAT_S)  # idle: no traffic but the pings, and /health stays 200
                assert _health(server)[0] == 200
                os.kill(w.proc.pid, signal.SIGSTOP)
                try:
                    took, body = _within(server, 503, HEARTBEAT_S + 1)
                    assert took <= HEARTBEAT_S + 0.5, took  # the bound, plus this loop's polling
                    assert body["error"].startswith(f"stage {stage} ({w.addr}) is down: worker {w.addr} sent "
                                                    f"nothing for "), body["error"]
                    assert [s["state"] for s in body["stages"]] == ["up", *("down" if i == stage else "up"
                                                                            for i in (1, 2))]
                    started = time.monotonic()
                    if stage == 2:  # back within the window: the waiting request is answered
                        threading.Timer(1.0, os.kill, (w.proc.pid, signal.SIGCONT)).start()
                        r = _chat(server, model)
                        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
                        assert time.monotonic() - started < WINDOW_S + 5
                    else:
                        r = _chat(server, model)
                        assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.text)
                        error = r.json()["error"]
                        assert error["code"] == "pipeline_unavailable"
                        assert error["message"].startswith(f"the pipeline is down, retry later: stage {stage} "
                                                           f"({w.addr})")
                        assert WINDOW_S <= time.monotonic() - started < WINDOW_S + 5  # it waited for a repair
                finally:
                    os.kill(w.proc.pid, signal.SIGCONT)  # again, for the second: harmless
                took, body = _within(server, 200, 15)
                assert [s["state"] for s in body["stages"]] == ["up"] * 3
                assert _answer(server)
    finally:
        for w in (w1, w2):
            w.stop()
