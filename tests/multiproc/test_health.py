"""/health tells the truth through real processes (issue 22 point 6): `shardline serve` over two
`shardline worker`s. A worker killed: 503 naming that stage at once, 200 again once it is back
(the idle chain is reopened in the background, no request has to fail first). A worker stopped
(SIGSTOP): a request's step outlives its deadline, then 503 naming it while it stays stopped;
200 once it is continued. Every wait is bounded. (An idle stopped worker: test_heartbeat.py.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.multiproc.procs import Proc, serve, worker

WAIT_S = 40.0


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


def _health(server: Proc) -> tuple[int, dict[str, Any]]:
    r = httpx.get(server.addr.removesuffix("/v1") + "/health", timeout=10)
    return r.status_code, r.json()


def _until(server: Proc, code: int) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while (got := _health(server))[0] != code:
        assert time.monotonic() < deadline, f"/health still {got} after {WAIT_S:g} s"
        time.sleep(0.2)
    return got[1]


def _answer(server: Proc) -> str:
    client = openai.OpenAI(base_url=server.addr, api_key="unused", timeout=60, max_retries=0)
    out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Say hi."}])
    return out.choices[0].message.content or ""


def test_health_follows_a_killed_and_a_stopped_worker(three: Path) -> None:
    w1, w2 = worker(three, "1"), worker(three, "2")
    restarted: list[Proc] = []
    try:
        with serve(["--shards", str(three), "--workers", f"{w1.addr},{w2.addr}", "--port", "0", "--insecure",
                    "--step-deadline", "1", "--reconnect-window", "2", "--replay-within", "2"]) as server:
            body = _until(server, 200)
            assert body["status"] == "ok" and [s["state"] for s in body["stages"]] == ["up"] * 3
            assert [s["where"] for s in body["stages"]] == ["this process", w1.addr, w2.addr]
            assert body["context"] == 8192 and body["kv_cache"] == "f32"
            assert _answer(server)

            w2.proc.kill()  # its links end: the chain breaks without any request
            w2.stop()
            body = _until(server, 503)
            assert body["status"] == "unhealthy" and body["error"].startswith(f"stage 2 ({w2.addr}) is down: ")
            assert body["stages"][2]["state"] == "down"
            restarted.append(worker(three, "2", port=w2.port))
            body = _until(server, 200)  # repaired while idle
            assert [s["state"] for s in body["stages"]] == ["up"] * 3
            assert _answer(server)

            os.kill(restarted[0].proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(openai.APIError):  # its step outlives the 1 s deadline; no repair in 2 s
                    _answer(server)
                body = _until(server, 503)
                # the stopped worker is named, not its neighbour (the one that answered its pings)
                assert body["error"].startswith(f"stage 2 ({w2.addr}) is down: "), body["error"]
                assert "did not answer" in body["error"] or "sent nothing" in body["error"], body["error"]
                time.sleep(3)  # background repairs fail while it stays stopped
                assert _health(server)[0] == 503
            finally:
                os.kill(restarted[0].proc.pid, signal.SIGCONT)
            _until(server, 200)
            assert _answer(server)
    finally:
        for w in (w1, w2, *restarted):
            w.stop()
