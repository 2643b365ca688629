"""The main job, end to end through the official `openai` client: `shardline serve` with no
arguments at all (the default model, from the cache, on 127.0.0.1:8000) answers; and
`shardline serve --workers` answers concurrent streams with the very tokens each gets alone.

The no-argument server must own port 8000 whatever the host runs, so it and its client run in a
private network namespace (`unshare --net`: only a loopback, brought up by the driver below,
which this file also is). Its cache is a temporary folder holding the default export, so the
test reads and writes nothing of the user's own cache."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from openai import OpenAI

from tests.conftest import CHAT_PROMPTS
from tests.multiproc.procs import Proc, serve, worker

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ADDRESS = "http://127.0.0.1:8000/v1"
CAPITAL = "What is the capital of France?"
NETNS_TIMEOUT_S = 180.0  # the driver: server start (stage compile), one answer, stop
N_STREAMS = 4
N_NEW = 24


# --- serve with no arguments, in a private network namespace ------------------------------------

def _unshare() -> list[str] | None:
    """The command prefix that gives a new network namespace: as root, or as a user mapped to
    root in a new user namespace (where unprivileged user namespaces are enabled); None if neither."""
    for prefix in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
    return None


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SHARDLINE_CACHE folder holding the default model's export, under the name
    default_shards() gives it (so `serve` without --shards finds it and exports nothing)."""
    from shardline.export.defaults import default_shards

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLINE_CACHE", str(cache))
        assert default_shards(progress=False).parent == cache
    return cache


def _in_private_network(prefix: list[str], command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run `command` in a new network namespace; its last stdout line, as JSON. The namespace
    dies with its last process; its own process group lets everything in it be killed at once."""
    proc = subprocess.Popen([*prefix, "--", *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=NETNS_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left: the driver, its server
        proc.wait(timeout=30)
    assert proc.returncode == 0 and out.strip(), (proc.returncode, out, err)
    return json.loads(out.strip().splitlines()[-1])


def test_serve_with_no_arguments_answers_the_openai_client(default_cache: Path) -> None:
    prefix = _unshare()
    if prefix is None:
        pytest.skip("no network namespace here (`unshare --net` needs root or unprivileged user namespaces)")
    env = os.environ | {"SHARDLINE_CACHE": str(default_cache),
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        # no proxy is reachable from the namespace: the client must go straight to loopback
                        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    got = _in_private_network(prefix, [sys.executable, __file__], env)
    assert got["address"] == DEFAULT_ADDRESS
    assert got["models"] == [got["model"]]
    assert "Paris" in got["answer"], got
    assert got["finish_reason"] in ("stop", "length")
    assert got["exit_code"] == 143, got["stderr"]
    assert "preparing the default model" not in got["stderr"], got["stderr"]  # the prepared cache served
    assert "(2 paged stages," in got["stderr"], got["stderr"]  # the default model is served paged (issue 41)


def _drive_default_server() -> dict[str, Any]:
    """Inside the namespace: bring up loopback, start `shardline serve` with no arguments, ask it
    once through the openai client, stop it with SIGTERM. Printed as one JSON line."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    with serve([]) as server:
        _wait_healthy(server.addr)
        client = OpenAI(base_url=server.addr, api_key="unused", timeout=60, max_retries=0)
        models = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(model=models[0], messages=[{"role": "user", "content": CAPITAL}],
                                               temperature=0, max_tokens=16)
        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(timeout=30)
        return {"address": server.addr, "models": models, "model": reply.model,
                "answer": reply.choices[0].message.content, "finish_reason": reply.choices[0].finish_reason,
                "exit_code": exit_code, "stderr": server.stderr()}


def _wait_healthy(api: str, timeout_s: float = 60.0) -> None:
    """Until GET /health beside the API at `api` (http://HOST:PORT/v1) answers 200."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(api):
        assert time.monotonic() < deadline, f"{api}: /health did not answer within {timeout_s:g} s"
        time.sleep(0.1)


def _healthy(api: str) -> bool:
    url = urlsplit(api)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


# --- serve --workers: concurrent streams equal the same requests alone ---------------------------

@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int  # completion tokens, as the server's usage counts them


def _decode_steps(api: str) -> float:
    """How many decode steps the coordinator has run (/metrics beside the API at `api`)."""
    url = urlsplit(api)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = re.findall(r'^shardline_step_seconds_count\{phase="decode"\} (\S+)$', text, re.M)
    assert len(found) == 1, text[-2000:]
    return float(found[0])


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


@pytest.fixture(scope="module")
def remote_server(three: Path) -> Iterator[Proc]:
    """`shardline serve` with stage 0 in its own process and stages 1 and 2 on two `shardline
    worker`s, at its defaults (exact precision: f32 hidden states on the wire), except that
    prompts arriving beside decoding streams are prefilled at full speed: paced (the default),
    the last of four prompts may start after the first 24-token answer ended, and these tests
    are about streams running together (the pacing has its own: test_pacing, test_engine)."""
    with worker(three, "1") as w1, worker(three, "2") as w2, serve(
            ["--shards", str(three), "--workers", f"{w1.addr},{w2.addr}", "--port", "0", "--insecure",
             "--prefill-budget", "100", "--prefill-share", "0.99"]) as s:
        _wait_healthy(s.addr)
        yield s


def _ask(client: OpenAI, model: str, prompt: str, start: threading.Barrier | None = None) -> Answer:
    """One streamed chat completion of exactly N_NEW greedy tokens (ignore_eos keeps every stream
    busy to the end, so concurrent streams overlap)."""
    if start is not None:
        start.wait(timeout=30)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        temperature=0, max_tokens=N_NEW, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, tokens = [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert text, f"no content for {prompt!r}"
    return Answer("".join(text), tokens)


def _in_process(folder: Path, prompts: list[str]) -> list[str]:
    """Each prompt's N_NEW greedy tokens with every stage in this process, as text."""
    from shardline.config import RunConfig, SamplingConfig
    from shardline.model.tokenizer import ChatTokenizer
    from shardline.pipeline.local import LocalPipeline
    from tests.helpers import engine_tokens

    tok = ChatTokenizer(folder)
    with LocalPipeline(folder, RunConfig()) as pipe:
        return [tok.decode(engine_tokens(pipe, tok.encode_chat([{"role": "user", "content": p}]),
                                         SamplingConfig(max_tokens=N_NEW), chunk=128)) for p in prompts]


def test_concurrent_streams_through_two_workers_equal_each_alone_and_the_in_process_engine(
        remote_server: Proc, three: Path) -> None:
    client = OpenAI(base_url=remote_server.addr, api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    prompts = CHAT_PROMPTS[:N_STREAMS]
    alone = [_ask(client, model, p) for p in prompts]
    steps = _decode_steps(remote_server.addr)
    start = threading.Barrier(N_STREAMS)
    with ThreadPoolExecutor(N_STREAMS) as pool:
        together = list(pool.map(lambda p: _ask(client, model, p, start), prompts))
    steps = _decode_steps(remote_server.addr) - steps
    assert [a.tokens for a in alone] == [N_NEW] * N_STREAMS
    assert [(a.text, a.tokens) for a in together] == [(a.text, a.tokens) for a in alone]
    # exact precision through workers is the in-process model's answer, token for token
    assert [a.text for a in together] == _in_process(three, prompts)
    # They really ran together: streams shared decode steps (alone, each token after the first
    # is a step of its own: N_STREAMS x (N_NEW - 1) steps)
    assert steps < N_STREAMS * (N_NEW - 1), steps


if __name__ == "__main__":
    print(json.dumps(_drive_default_server()))
