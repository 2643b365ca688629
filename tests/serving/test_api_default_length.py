"""A request without max_tokens may run to what is left of the context (issue 36, as vLLM and
llama-server do); an explicit max_tokens past the context is still a 400. A real `shardline
serve` at --context 512, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shardline.api.generation import UNKNOWN_CONTEXT_MAX_TOKENS, fitted_max_tokens
from tests.serving.test_api import MODEL, Server

CONTEXT = 512


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2", "--context", str(CONTEXT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120) as c:
        yield c


def test_the_default_fits_what_is_left_of_the_context() -> None:
    assert fitted_max_tokens(None, 512, 492) == 20
    assert fitted_max_tokens(256, 512, 100) == 256  # a server's own default, when it fits
    assert fitted_max_tokens(256, 512, 400) == 112
    assert fitted_max_tokens(None, 512, 512) == 1  # nothing left: the engine refuses it as too long
    assert fitted_max_tokens(None, 0, 10) == UNKNOWN_CONTEXT_MAX_TOKENS and fitted_max_tokens(7, 0, 10) == 7


def test_a_prompt_near_the_context_without_max_tokens_is_answered_to_the_end(client: openai.OpenAI) -> None:
    """The audit's case: a 492-token prompt at --context 512 got a 400 (492 + the old default 256)."""
    prompt = [100 + i % 400 for i in range(492)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (492, 20)
    assert r.choices[0].finish_reason == "length"


def test_an_explicit_max_tokens_past_the_context_is_still_a_400(client: openai.OpenAI) -> None:
    prompt = [100 + i % 400 for i in range(492)]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=21, temperature=0)
    assert e.value.code == "context_length_exceeded" and "exceeds the context of 512" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that fills the context leaves nothing
        client.completions.create(model=MODEL, prompt=[100] * CONTEXT, temperature=0)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("bad", [0, -5])
def test_a_server_default_below_one_is_a_clear_error(bad: int) -> None:
    from shardline.config import ServeConfig
    from shardline.errors import ShardlineError

    with pytest.raises(ShardlineError, match="--max-tokens must be >= 1"):
        ServeConfig(default_max_tokens=bad)
    assert ServeConfig().default_max_tokens is None
