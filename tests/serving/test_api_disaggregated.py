"""`shardline serve --disaggregate 1:1`: a real server process of one prefill and one decode
instance behind the OpenAI API, driven by the official client. Its greedy answers equal a
coupled engine's, concurrent and streamed, a prompt kept by the prefill instance or not;
/health and /metrics tell the truth; bad flags get a clear error before anything loads."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.disagg.predictor import BUNDLED
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from shardline.serving.generate import tokens
from tests.conftest import CHAT_PROMPTS
from tests.serving.test_api import MODEL, SHARDLINE, Server

N_NEW = 24


@pytest.fixture(scope="module")
def server(balanced: Path) -> Iterator[Server]:
    s = Server(balanced, "--disaggregate", "1:1", "--max-streams", "4", "--prefill-policy", "sjf")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def coupled_answers(folder: Path, n_new: int) -> dict[str, str]:
    """Each chat prompt's greedy answer from a coupled engine in this process."""
    tok = ChatTokenizer(folder)
    pipe = LocalPipeline(folder, RunConfig())
    engine = Engine(pipe, Limits(1, 1), 8192)
    try:
        return {p: tok.decode(tokens(engine, tok.encode_chat([{"role": "user", "content": p}]),
                                     SamplingConfig(max_tokens=n_new), tok.stop_ids)) for p in CHAT_PROMPTS}
    finally:
        engine.stop()
        pipe.shutdown()


def greedy_chat(client: openai.OpenAI, model: str, prompt: str, n_new: int) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=n_new, temperature=0)
    return r.choices[0].message.content or ""


@pytest.fixture(scope="module")
def alone(balanced: Path) -> dict[str, str]:
    return coupled_answers(balanced, N_NEW)


def _chat(client: openai.OpenAI, prompt: str) -> str:
    return greedy_chat(client, MODEL, prompt, N_NEW)


def test_the_bundled_predictor_serves_decode_lengths(server: Server) -> None:
    assert any(f"decode lengths predicted by {BUNDLED.name}" in line for line in server.said), server.said


def test_concurrent_answers_equal_a_coupled_engine(client: openai.OpenAI, alone: dict[str, str]) -> None:
    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        got = dict(zip(CHAT_PROMPTS, pool.map(lambda p: _chat(client, p), CHAT_PROMPTS), strict=True))
    assert got == alone


def test_stream_equals_plain(client: openai.OpenAI, alone: dict[str, str]) -> None:
    p = CHAT_PROMPTS[1]
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                            max_tokens=N_NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone[p]


def test_health_and_metrics_after_the_requests(server: Server, client: openai.OpenAI,
                                               alone: dict[str, str]) -> None:
    """The prefill instance keeps each prompt it prefills: the same prompt again starts from it,
    with the same answer."""
    _chat(client, CHAT_PROMPTS[0])
    hits, saved = server.metric("shardline_prefix_cache_hits_total"), server.metric(
        "shardline_prefix_cache_tokens_saved_total")
    assert _chat(client, CHAT_PROMPTS[0]) == alone[CHAT_PROMPTS[0]]
    assert server.metric("shardline_prefix_cache_hits_total") == hits + 1
    assert server.metric("shardline_prefix_cache_tokens_saved_total") - saved >= 16
    assert server.metric("shardline_prefix_cache_bytes") > 0
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["waiting"] == 0
    assert server.metric("shardline_max_streams") == 4  # the decode instance's slots
    assert server.metric('shardline_requests_total{endpoint="chat",finish_reason="length"}') >= 1
    fleet = httpx.get(f"{server.url}/fleet.json", timeout=10).json()  # the page's data: no chain drawn yet
    assert (fleet["status"], fleet["stages"], fleet["streams"]["max"]) == ("ok", [], 4)


@pytest.mark.parametrize("flags, said", [
    (["--disaggregate", "0:1"], "--disaggregate P:D needs 1-16 prefill and 1-16 decode instances"),
    (["--disaggregate", "2"], "--disaggregate must be P:D"),
    (["--disaggregate", "1:x"], "--disaggregate must be P:D"),
    (["--disaggregate", "1:17"], "needs 1-16 prefill and 1-16 decode"),
    (["--disaggregate", "1:1", "--admission", "greedy"], "--admission must be one of vanilla, reserve-static"),
    (["--disaggregate", "1:1", "--prefill-policy", "lifo"], "--prefill-policy must be one of fcfs, sjf, ljf"),
    (["--disaggregate", "1:1", "--draft", "ngram"], "it cannot be combined with --draft yet"),
    (["--disaggregate", "1:1", "--length-predictor", "/no/such/model.json"],
     "--length-predictor: cannot read the length predictor /no/such/model.json: FileNotFoundError"),
    (["--disaggregate", "1:1", "--length-predictor", str(BUNDLED)],  # `two` is split evenly
     "--length-predictor: the length predictor was trained for stage0_layers [0, 18]; this export has [0, 14]"),
    (["--disaggregate", "1:1", "--length-predictor", ""], "--length-predictor must be auto, max-tokens or a model"),
    (["--disaggregate", "1:1", "--kv-transfer", "layer"], "--kv-transfer must be one of request, chunk, got 'layer'"),
])
def test_bad_flags_get_a_clear_error(two: Path, flags: list[str], said: str) -> None:
    done = subprocess.run([SHARDLINE, "serve", "--shards", str(two), "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and said in done.stderr, done.stderr


def test_a_constrained_answer_is_the_coupled_one(balanced: Path, client: openai.OpenAI) -> None:
    """The grammar's state travels with the stream from the prefill to the decode instance: the
    JSON answer equals a coupled engine's, asked twice (the second from the kept prompt)."""
    import json

    import jsonschema

    from shardline.model.grammar import Grammars, GrammarSpec
    from shardline.model.manifest import load_manifest
    from shardline.serving.engine import Request
    from tests.serving.test_constrained import ASK, PERSON, _run

    tok = ChatTokenizer(balanced)
    grammars = Grammars((balanced / "tokenizer.json").read_text(), load_manifest(balanced).arch.vocab, tok.stop_ids)
    with LocalPipeline(balanced, RunConfig()) as pipe:
        engine = Engine(pipe, Limits(1, 1), 8192)
        try:
            [(want, _)] = _run(engine, [Request(tok.encode_chat([{"role": "user", "content": ASK}]),
                                                SamplingConfig(max_tokens=96), frozenset(tok.stop_ids),
                                                constraint=grammars.constraint(GrammarSpec.json_schema(PERSON)))])
        finally:
            engine.stop()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for _ in range(2):
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=96,
                                             temperature=0, response_format=fmt).choices[0].message.content or ""
        assert got == tok.decode(want)
    jsonschema.validate(json.loads(got), PERSON)
