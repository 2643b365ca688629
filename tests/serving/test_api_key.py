"""`shardline serve --api-key-file`: /v1 requests need `Authorization: Bearer KEY` (401 in
OpenAI's error format otherwise, before the body is read); /health and /metrics stay open.
With several keys, each is served, and kept prompt prefixes are never shared between them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.serving.test_api import MODEL, Server

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(two: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    s = Server(two, "--max-streams", "1", "--api-key-file", str(key_file))
    yield s
    s.stop()


def _chat(client: openai.OpenAI) -> str:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    return out.choices[0].message.content or ""


@pytest.fixture(scope="module")
def two_keys(two: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"{KEY}\n\n{OTHER}\n")
    s = Server(two, "--max-streams", "1", "--api-key-file", str(key_file), "--prefix-cache-mb", "64")
    yield s
    s.stop()


OTHER = "sk-other-0123456789abcdef"
LONG = "Answer in one word. " + "The bicycle is an efficient machine for moving people about. " * 6


def test_each_of_several_keys_is_served_and_keeps_its_prefixes_to_itself(two_keys: Server) -> None:
    def ask(key: str, question: str) -> tuple[float, float]:
        client = openai.OpenAI(base_url=f"{two_keys.url}/v1", api_key=key, max_retries=0)
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[{"role": "system", "content": LONG},
                                                 {"role": "user", "content": question}])
        return (two_keys.metric("shardline_prefix_cache_hits_total"),
                two_keys.metric("shardline_prefix_cache_misses_total"))

    assert ask(KEY, "Why?") == (0, 1)
    assert ask(OTHER, "How?") == (0, 2)  # the same system prompt, another key: a miss
    assert ask(KEY, "When?") == (1, 2)  # the first key's own: a hit
    assert ask(OTHER, "Where?") == (2, 2)
    with pytest.raises(openai.AuthenticationError):
        ask("sk-third-0123456789abcdef", "Who?")


def test_the_right_key_is_served(keyed: Server) -> None:
    assert _chat(openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0))


@pytest.mark.parametrize("given,message", [
    ("sk-wrong-0123456789abcdef", "incorrect API key provided"),
    (KEY + "x", "incorrect API key provided"),
    (KEY[:-1], "incorrect API key provided"),
])
def test_a_wrong_key_gets_401_in_openai_format(keyed: Server, given: str, message: str) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        _chat(openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=given, max_retries=0))
    assert e.value.status_code == 401
    assert e.value.body == {"message": message, "type": "invalid_request_error", "param": None,
                            "code": "invalid_api_key"}


def test_no_key_gets_401_before_the_body_is_read(keyed: Server) -> None:
    r = httpx.post(f"{keyed.url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["message"] == "missing API key: send it as 'Authorization: Bearer KEY'"
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Basic " + KEY}, timeout=30)
    assert r.status_code == 401


def test_health_and_metrics_need_no_key(keyed: Server) -> None:
    assert httpx.get(f"{keyed.url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.get(f"{keyed.url}/metrics", timeout=30).status_code == 200
