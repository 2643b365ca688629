"""`shardline serve --draft ngram` driven by the official `openai` client: the same text as the
in-process plain greedy answer, the per-stream and total speculation figures in /metrics, and
`"speculative": false` turning it off for one request."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from tests.helpers import engine_tokens
from tests.serving.test_api import MODEL, Server

TEXT = "Repeat this list twice, exactly: apples, pears, plums, cherries, grapes, melons."
N = 48


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2", "--draft", "ngram", "--draft-k", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_text(two: Path) -> str:
    tok = ChatTokenizer(two)
    with LocalPipeline(two, RunConfig()) as pipe:
        ids = engine_tokens(pipe, tok.encode_chat([{"role": "user", "content": TEXT}]), SamplingConfig(max_tokens=N))
    return tok.decode(ids)


def _ask(client: openai.OpenAI, **extra: object) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}], max_tokens=N,
                                       temperature=0, extra_body={"ignore_eos": True, **extra})
    return r.choices[0].message.content or ""


def test_speculative_server_answers_the_plain_text_and_counts_its_drafts(client: openai.OpenAI, server: Server,
                                                                        plain_text: str) -> None:
    before = server.metric("shardline_spec_drafted_tokens_total")
    assert _ask(client) == plain_text
    drafted = server.metric("shardline_spec_drafted_tokens_total") - before
    assert drafted > 0
    assert 0 < server.metric("shardline_spec_accepted_tokens_total") <= server.metric(
        "shardline_spec_drafted_tokens_total")
    # By position, the same drafts: summed over positions, the totals (nothing is running now).
    assert server.metric("shardline_spec_offered_at_position_total") == server.metric(
        "shardline_spec_drafted_tokens_total")
    assert server.metric("shardline_spec_accepted_at_position_total") == server.metric(
        "shardline_spec_accepted_tokens_total")


def test_a_request_can_turn_speculation_off(client: openai.OpenAI, server: Server, plain_text: str) -> None:
    before = server.metric("shardline_spec_verify_steps_total")
    assert _ask(client, speculative=False) == plain_text
    assert server.metric("shardline_spec_verify_steps_total") == before


def test_running_streams_show_their_own_figures(client: openai.OpenAI, server: Server) -> None:
    done = threading.Event()

    def long_request() -> None:
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}], max_tokens=400,
                                           temperature=0, extra_body={"ignore_eos": True})
        finally:
            done.set()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    figures: dict[str, float] = {}
    while not done.is_set() and time.monotonic() < deadline and not figures.get("drafted"):
        figures = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^shardline_spec_stream_(\w+)\{stream="\d+"\} (\S+)$', httpx.get(f"{server.url}/metrics").text, re.M)}
        time.sleep(0.05)
    t.join(120)
    assert figures["k"] == 4.0  # --draft-k 4: the stream's verify steps offer 4
    assert 0 <= figures["accepted"] <= figures["drafted"] and figures["drafted"] % 4 == 0
