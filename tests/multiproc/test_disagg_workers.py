"""`shardline serve --disaggregate 1:1 --workers A,B` (issue 13): a prefill and a decode instance,
each with stage 0 in the server and stage 1 on a worker process of its own, over mutual TLS on
loopback. Every prompt is prefilled on A's chain in chunks of 16, each chunk's KV pulled from A
as soon as it has run (`--kv-transfer chunk`), the whole pushed to B over the links, and decoded
on B's: greedy answers equal a coupled run's, concurrent and streamed. The
bundled length predictor reads stage 0's summaries there too. A worker count that does not fit
the instances gets a clear error before anything starts."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from shardline.cluster.keygen import keygen
from shardline.disagg.predictor import BUNDLED
from tests.conftest import CHAT_PROMPTS
from tests.multiproc.procs import SHARDLINE, Proc, serve, worker
from tests.serving.test_api_disaggregated import coupled_answers, greedy_chat

N_NEW = 20
MODEL = "smollm2-test"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("disagg-tls") / "cluster"
    keygen(out, 3)
    return out


@pytest.fixture(scope="module")
def server(balanced: Path, cluster: Path) -> Iterator[tuple[Proc, list[Proc]]]:
    """The server, and its two workers (stage 1 each): the prefill instance's, the decode one's."""
    workers = [worker(balanced, "1", credentials=cluster / f"node-{i}") for i in (1, 2)]
    try:
        s = serve(["--shards", str(balanced), "--port", "0", "--model-id", MODEL, "--disaggregate", "1:1",
                   "--workers", ",".join(w.addr for w in workers), "--credentials", str(cluster / "node-0"),
                   "--max-streams", "4", "--kv-transfer", "chunk", "--prefill-chunk", "16"])
    except BaseException:
        for w in workers:
            w.stop()
        raise
    yield s, workers
    s.stop()
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def client(server: tuple[Proc, list[Proc]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].addr, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alone(balanced: Path) -> dict[str, str]:
    return coupled_answers(balanced, N_NEW)


def _chat(client: openai.OpenAI, prompt: str) -> str:
    return greedy_chat(client, MODEL, prompt, N_NEW)


def test_answers_over_two_worker_chains_equal_a_coupled_run(server: tuple[Proc, list[Proc]], client: openai.OpenAI,
                                                            alone: dict[str, str]) -> None:
    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        got = dict(zip(CHAT_PROMPTS, pool.map(lambda p: _chat(client, p), CHAT_PROMPTS), strict=True))
    assert got == alone
    p = CHAT_PROMPTS[2]
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                            max_tokens=N_NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone[p]
    proc, workers = server
    assert f"decode lengths predicted by {BUNDLED.name}" in proc.stderr()
    health = httpx.get(proc.addr.removesuffix("/v1") + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["waiting"] == 0
    assert all(w.proc.poll() is None for w in workers)


def test_a_worker_count_that_does_not_fit_the_instances_is_refused(balanced: Path) -> None:
    done = subprocess.run([SHARDLINE, "serve", "--shards", str(balanced), "--port", "0", "--disaggregate", "2:1",
                           "--workers", "127.0.0.1:9,127.0.0.1:10", "--insecure"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert ("each of the 3 instances runs stage 0 here and the later stages on a chain of its own; 2 workers do "
            "not split evenly into 3 chains") in done.stderr, done.stderr
