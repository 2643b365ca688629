"""`shardline serve` keeps ended requests' KV for prompts that start alike (issue 26), driven by
the official `openai` client: a chat's later turns and a shared system prompt start from a kept
prefix and answer exactly as with `"cache_prompt": false` (a cold prefill), greedy and with a
seed; /metrics counts hits, misses, tokens saved and the bytes kept; a bad `cache_prompt` is a
400 for that request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import CHAT_PROMPTS
from tests.serving.test_api import MODEL, Server

SYSTEM = {"role": "system", "content": "You answer questions such as these: " + " ".join(CHAT_PROMPTS)}


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2", "--prefix-cache-mb", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _say(client: openai.OpenAI, messages: list[dict[str, str]], cache: bool = True, **sampling: object) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,  # type: ignore[arg-type]
                                       extra_body={"cache_prompt": cache}, **sampling)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def test_a_chat_s_later_turns_start_from_the_kept_conversation_and_answer_as_cold(client: openai.OpenAI,
                                                                                   server: Server) -> None:
    messages = [SYSTEM]
    hits = server.metric("shardline_prefix_cache_hits_total")
    for turn, question in enumerate(CHAT_PROMPTS[2:5]):
        messages.append({"role": "user", "content": question})
        cold = _say(client, messages, cache=False, temperature=0)
        saved = server.metric("shardline_prefix_cache_tokens_saved_total")
        warm = _say(client, messages, temperature=0)
        assert warm == cold
        if turn:  # the turn before was kept: this one prefills only its new message
            assert server.metric("shardline_prefix_cache_tokens_saved_total") - saved > 40
        messages.append({"role": "assistant", "content": warm})
    assert server.metric("shardline_prefix_cache_hits_total") - hits >= 2
    assert server.metric("shardline_prefix_cache_bytes") > 0


def test_a_shared_system_prompt_is_reused_across_requests_with_the_same_seeded_draws(client: openai.OpenAI,
                                                                                      server: Server) -> None:
    _say(client, [SYSTEM, {"role": "user", "content": CHAT_PROMPTS[0]}])
    for question in CHAT_PROMPTS[1:3]:
        messages = [SYSTEM, {"role": "user", "content": question}]
        cold = _say(client, messages, cache=False, temperature=0.9, seed=11)
        hits = server.metric("shardline_prefix_cache_hits_total")
        assert _say(client, messages, temperature=0.9, seed=11) == cold
        assert server.metric("shardline_prefix_cache_hits_total") == hits + 1


def test_an_opted_out_request_is_neither_a_hit_nor_a_miss_and_a_bad_flag_is_a_400(client: openai.OpenAI,
                                                                                  server: Server) -> None:
    counted = server.metric("shardline_prefix_cache_hits_total") + server.metric("shardline_prefix_cache_misses_total")
    _say(client, [SYSTEM, {"role": "user", "content": CHAT_PROMPTS[3]}], cache=False)
    assert server.metric("shardline_prefix_cache_hits_total") + server.metric(
        "shardline_prefix_cache_misses_total") == counted
    for bad in ("yes", 1, None):
        with pytest.raises(openai.BadRequestError, match="cache_prompt"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"cache_prompt": bad})
