"""A real `shardline serve` process driven by the official `openai` client (and raw HTTP where
the wire format itself is the point): chat, completions, streaming, stop sequences, usage,
errors, concurrency, and a cancelled stream freeing its KV."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from shardline.serving.generate import tokens
from tests.conftest import CHAT_PROMPTS

SHARDLINE = str(Path(sys.executable).parent / "shardline")
MODEL = "test-model"
N_NEW = 16


class Server:
    def __init__(self, folder: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [SHARDLINE, "serve", "--shards", str(folder), "--port", "0", "--model-id", MODEL, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self.said: list[str] = []  # what it printed before it served (a bounded count of lines)
        while len(self.said) < 20 and (line := self.proc.stderr.readline()):
            self.said.append(line)
            if found := re.search(r"on (http://[\d.]+:\d+)/v1", line):
                self.url = found.group(1)
                return
        self.proc.kill()
        self.proc.wait(timeout=30)
        raise AssertionError(f"the server did not start: {''.join(self.said)}")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(two: Path) -> ChatTokenizer:
    return ChatTokenizer(two)


@pytest.fixture(scope="module")
def alone(two: Path, tok: ChatTokenizer) -> dict[str, str]:
    """Greedy answers computed in-process: what each request must return over HTTP."""
    pipe = LocalPipeline(two, RunConfig())
    engine = Engine(pipe, Limits(1, 1), 8192)
    out = {}
    try:
        for p in CHAT_PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": p}])
            out[p] = tok.decode(tokens(engine, ids, SamplingConfig(max_tokens=N_NEW), tok.stop_ids))
    finally:
        engine.stop()
        pipe.shutdown()
    return out


def _chat(client: openai.OpenAI, prompt: str, **kw: object) -> openai.types.chat.ChatCompletion:
    args: dict[str, object] = {"max_tokens": N_NEW, "temperature": 0} | kw
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          **args)  # type: ignore[call-overload]


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_answer_and_usage(client: openai.OpenAI, alone: dict[str, str]) -> None:
    r = _chat(client, CHAT_PROMPTS[0])
    assert r.choices[0].message.content == alone[CHAT_PROMPTS[0]] == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (37, 7, 44)


def test_length_finish_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = _chat(client, CHAT_PROMPTS[1], max_tokens=None, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_chat_stream_equals_plain(client: openai.OpenAI, alone: dict[str, str]) -> None:
    chunks = list(_chat(client, CHAT_PROMPTS[2], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone[CHAT_PROMPTS[2]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == N_NEW


def test_sse_ends_with_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}
    lines = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).text.strip().split("\n\n")
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: {") for x in lines[:-1])


def test_completion_plain_and_stream(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert plain.choices[0].text.startswith(" Paris")
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens == 8


def test_stop_sequence(client: openai.OpenAI) -> None:
    r = _chat(client, CHAT_PROMPTS[0], stop=[" Paris"])
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"
    s = _chat(client, CHAT_PROMPTS[0], stop=" Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == "The capital of France is"


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    a, b = (_chat(client, CHAT_PROMPTS[3], temperature=0.9, seed=11, top_p=0.95,
                                    extra_body={"top_k": 40}) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be less than or equal to 2"):
        _chat(client, "hi", temperature=5)
    with pytest.raises(openai.BadRequestError, match="messages: List should have at least 1 item"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="exceeds the context of 8192") as e:
        _chat(client, "hi", max_tokens=9000)
    assert e.value.code == "context_length_exceeded"


def test_malformed_json(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_concurrent_requests_equal_alone(client: openai.OpenAI, alone: dict[str, str]) -> None:
    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        got = list(pool.map(lambda p: _chat(client, p).choices[0].message.content, CHAT_PROMPTS))
    assert got == [alone[p] for p in CHAT_PROMPTS]


def test_cancelled_stream_frees_its_stream(server: Server, client: openai.OpenAI, alone: dict[str, str]) -> None:
    cancelled_before = server.metric('shardline_requests_total{endpoint="chat",finish_reason="cancelled"}')
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: _chat(client, CHAT_PROMPTS[4]).choices[0].message.content)
        stream = _chat(client, CHAT_PROMPTS[1], max_tokens=400, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert server.metric("shardline_active_streams") >= 1
        stream.close()  # the client goes away mid-answer
        assert other.result(timeout=120) == alone[CHAT_PROMPTS[4]]
    deadline = time.monotonic() + 30
    while server.metric("shardline_active_streams") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("shardline_active_streams") == 0
    assert server.metric('shardline_requests_total{endpoint="chat",finish_reason="cancelled"}') == \
        cancelled_before + 1


def test_metrics_report_latencies_queue_and_stage_time(server: Server, client: openai.OpenAI) -> None:
    gaps = server.metric("shardline_token_gap_seconds_count")
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                            max_tokens=8, temperature=0)
    assert answer.usage is not None
    # every gap between two of its tokens, whatever else ran
    assert server.metric("shardline_token_gap_seconds_count") >= gaps + answer.usage.completion_tokens - 1
    for phase in ("prefill", "decode"):  # prefill against decode time, per stage
        assert server.metric(f'shardline_stage_graph_seconds_sum{{phase="{phase}",stage="0"}}') > 0
    assert server.metric("shardline_time_to_first_token_seconds_count") >= 1
    assert server.metric("shardline_time_per_output_token_seconds_count") >= 1
    assert server.metric("shardline_e2e_request_latency_seconds_count") >= 1
    assert server.metric("shardline_queue_depth") == 0
    assert server.metric("shardline_max_streams") == 4
    for stage in (0, 1):  # both local stages' graph time, per decode step
        assert server.metric(f'shardline_stage_graph_seconds_count{{phase="decode",stage="{stage}"}}') >= 6
