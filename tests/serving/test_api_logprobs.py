"""Log-probabilities through a real `shardline serve`, in OpenAI's shapes, read with the
official client: chat (`logprobs`, `top_logprobs`) and legacy completions (`logprobs: N`),
plain and streamed; and each token's own text and bytes from the vocabulary."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from shardline.api.logprobs import TokenText, byte_alphabet
from shardline.model.tokenizer import ChatTokenizer
from tests.conftest import CHAT_PROMPTS
from tests.serving.test_api import MODEL, N_NEW, Server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def text(two: Path) -> TokenText:
    return TokenText(ChatTokenizer(two))


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"max_tokens": N_NEW, "temperature": 0,
                            "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}]} | kw
    return client.chat.completions.create(model=MODEL, **args)


def _entries(content: list[Any]) -> list[tuple[str, float, list[int], list[tuple[str, float]]]]:
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def _close(floats: list[float]) -> Any:
    """The same log-probabilities to 1e-4: a prompt planned while another stream's last step is
    still in flight is chunked by the pacing, and in this precision a chunk's width moves the
    logits in their 6th digit (the tokens are the same: test_engine's exactness tests)."""
    return pytest.approx(floats, abs=1e-4)


# --- each token's text and bytes (no server) ----------------------------------------------------

def test_byte_alphabet_is_the_byte_level_one() -> None:
    table = byte_alphabet()
    assert set(table) == set(ByteLevel.alphabet()) and sorted(table.values()) == list(range(256))
    assert (table["Ġ"], table["Ċ"], table["a"]) == (ord(" "), ord("\n"), ord("a"))


def test_token_bytes_spell_any_text(two: Path, text: TokenText) -> None:
    """Multi-byte characters split over tokens still give back their exact UTF-8 bytes; a token
    holding part of a character is shown with \\x escapes."""
    tok = ChatTokenizer(two)
    sample = "日本語の文章 café naïve 🙂🚀 — ½ ﬁ\n\tend"
    ids = tok.encode(sample)
    assert b"".join(text.bytes_of(t) for t in ids) == sample.encode()
    partial = [t for t in ids if not _valid_utf8(text.bytes_of(t))]
    assert partial, "the sample should split some character over tokens"
    assert all("\\x" in text.text_of(t) for t in partial)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_token_text_matches_the_tokenizer_for_whole_characters(two: Path, text: TokenText) -> None:
    tok = ChatTokenizer(two)
    raw = tok._tok
    for t in range(tok.vocab_size):
        b = text.bytes_of(t)
        if _valid_utf8(b):
            assert text.text_of(t) == raw.decode([t], skip_special_tokens=False), t
    assert text.text_of(tok.eos_id) == tok.eos_token


# --- chat ---------------------------------------------------------------------------------------

def test_chat_logprobs_are_consistent(client: openai.OpenAI) -> None:
    r = _chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 7
    assert "".join(e.token for e in content) == r.choices[0].message.content == "The capital of France is Paris."
    for e in content:
        assert e.bytes == list(e.token.encode())
        tops = e.top_logprobs
        assert len(tops) == 3
        assert (tops[0].token, tops[0].logprob) == (e.token, pytest.approx(e.logprob, abs=1e-9))  # greedy
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert all(t.logprob <= 0 for t in tops)
        assert sum(math.exp(t.logprob) for t in tops) <= 1 + 1e-9
        assert len({t.token for t in tops}) == 3
    assert content[-1].logprob > -1.0  # "." after "Paris" is near-certain for this model


def test_chat_stream_carries_the_same_logprobs(client: openai.OpenAI) -> None:
    plain = _entries(_chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content)
    chunks = list(_chat(client, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(t, b, [tok for tok, _ in top]) for t, _, b, top in _entries(streamed)] == \
        [(t, b, [tok for tok, _ in top]) for t, _, b, top in plain]
    assert [lp for e in _entries(streamed) for lp in (e[1], *(v for _, v in e[3]))] == \
        _close([lp for e in plain for lp in (e[1], *(v for _, v in e[3]))])
    for c in chunks:  # each chunk carries exactly the tokens of its text
        if c.choices and c.choices[0].logprobs:
            assert "".join(e.token for e in c.choices[0].logprobs.content) == c.choices[0].delta.content


def test_chat_logprobs_without_alternatives_and_without_asking(client: openai.OpenAI) -> None:
    r = _chat(client, logprobs=True, max_tokens=4)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[]] * 4
    assert _chat(client, max_tokens=4).choices[0].logprobs is None
    assert _chat(client, logprobs=False, top_logprobs=0, max_tokens=4).choices[0].logprobs is None


def test_sampled_token_logprob_is_the_models_own(client: openai.OpenAI) -> None:
    """Sampled (temperature 1, seeded), the chosen token is sometimes not the most likely; its
    logprob is still under the model's own distribution: it equals its entry among the top 20."""
    r = _chat(client, logprobs=True, top_logprobs=20, temperature=1.0, seed=7, max_tokens=24,
              messages=[{"role": "user", "content": CHAT_PROMPTS[3]}])
    content = r.choices[0].logprobs.content
    listed = [(e, next(t for t in e.top_logprobs if t.token == e.token)) for e in content
              if any(t.token == e.token for t in e.top_logprobs)]
    assert len(listed) >= len(content) // 2
    assert all(t.logprob == pytest.approx(e.logprob, abs=1e-9) for e, t in listed)
    assert any(e.token != e.top_logprobs[0].token for e in content), "nothing but greedy picks"
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-9 for e in content)


def test_stop_sequence_drops_the_tokens_it_cut(client: openai.OpenAI) -> None:
    for stream in (False, True):
        if stream:
            chunks = list(_chat(client, logprobs=True, stop=" Paris", stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            r = _chat(client, logprobs=True, stop=" Paris")
            got, content = r.choices[0].message.content, r.choices[0].logprobs.content
        assert got == "The capital of France is" == "".join(e.token for e in content)


# --- legacy completions -------------------------------------------------------------------------

def _legacy(lp: Any) -> tuple[list[str], list[float], list[dict[str, float]], list[int]]:
    return lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset


def test_completion_logprobs_plain_and_streamed(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    tokens, lps, tops, offsets = _legacy(plain.choices[0].logprobs)
    assert "".join(tokens) == plain.choices[0].text and tokens[0] == " Paris"
    assert len(tokens) == len(lps) == len(tops) == len(offsets) == 8
    for token, lp, top in zip(tokens, lps, tops, strict=True):
        assert len(top) == 3 and top[token] == lp == max(top.values())  # greedy: the chosen is the best
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-9
    assert offsets == [len(PROMPT) + len("".join(tokens[:i])) for i in range(8)]  # from the prompt's start
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                              stream=True))
    parts = [_legacy(c.choices[0].logprobs) for c in streamed if c.choices[0].logprobs]
    s_tokens, s_lps, s_tops, s_offsets = (sum((list(p[i]) for p in parts), []) for i in range(4))
    assert (s_tokens, s_offsets, [list(t) for t in s_tops]) == (tokens, offsets, [list(t) for t in tops])
    assert s_lps == _close(lps)
    assert [v for t in s_tops for v in t.values()] == _close([v for t in tops for v in t.values()])


def test_completion_logprobs_zero_gives_the_chosen_token_only(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    tokens, lps, tops, _ = _legacy(r.choices[0].logprobs)
    assert tops == [{t: lp} for t, lp in zip(tokens, lps, strict=True)]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_from_token_ids(client: openai.OpenAI, two: Path) -> None:
    ids = ChatTokenizer(two).encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    assert _legacy(by_ids.choices[0].logprobs) == _legacy(by_text.choices[0].logprobs)
