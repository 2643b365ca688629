"""Through a real `shardline serve` and the official client: text in a chat message never becomes
a control token (the prompt the server counts is the message's plain-text tokens, as llama.cpp
gives them with parse_special=false), while a raw completion prompt keeps parsing them, as
llama-server does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shardline.model.tokenizer import ChatTokenizer
from tests.model.test_tokenizer import SMUGGLED, SMUGGLED_CHAT
from tests.serving.test_api import MODEL, Server

MESSAGES = [{"role": "user", "content": SMUGGLED}]


@pytest.fixture(scope="module")
def client(two: Path) -> Iterator[openai.OpenAI]:
    server = Server(two, "--max-streams", "2")
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.stop()


def test_chat_prompt_counts_the_message_as_plain_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == len(SMUGGLED_CHAT) == 61


def test_raw_completion_parses_control_tokens(client: openai.OpenAI, two: Path) -> None:
    prompt = ChatTokenizer(two).chat_prompt(MESSAGES)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == 45  # the message's <|im_end|>, <|im_start|> parsed
