"""Log-probabilities in OpenAI's shapes: each token's own text and bytes, and the per-token
entries of chat (`logprobs.content`) and legacy completions (`tokens`, `token_logprobs`, ...).

A token's bytes come from its vocabulary entry, not from decoding it alone: a byte-level BPE
token that holds part of a multi-byte character has no text of its own, but its bytes are
exact, read through the byte-level alphabet (each byte is written as one printable character
in the vocabulary). Its `token` string is those bytes as UTF-8 with the incomplete sequence
shown as `\\xNN` escapes, as OpenAI does. Vocabularies that are not byte-level (SentencePiece
style) give `<0xNN>` byte tokens and `▁` for a space; anything else is taken as UTF-8 text,
which is exact for whole-character tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from shardline.model.tokenizer import ChatTokenizer

# A log-probability that cannot be written in JSON (-inf for a token the model rules out) is
# reported as OpenAI reports such tokens.
FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its log-probability, the most likely alternatives at its position
    (most likely first), and where its text starts in the completion (characters)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int


def byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves; every other byte (controls, space, ...) is written as the code point 256 + its
    rank among those bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in table]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _is_byte_level(spec: object) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence) includes the ByteLevel decoder."""
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == "ByteLevel" or any(_is_byte_level(d) for d in spec.get("decoders") or [])


class TokenText:
    """Each token's own bytes and text (cached: a server sees the same tokens again and again)."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._raw: Tokenizer = tok.raw  # the vocabulary itself
        self._byte_level = _is_byte_level(json.loads(self._raw.to_str()).get("decoder"))
        self._alphabet = byte_alphabet()
        self._added = {i: t.content for i, t in self._raw.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._bytes(token)
        return got

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="backslashreplace")

    def _bytes(self, token: int) -> bytes:
        if token in self._added:  # special tokens are literal text, never byte-encoded
            return self._added[token].encode()
        piece = self._raw.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_level:
            return b"".join(bytes([self._alphabet[c]]) if c in self._alphabet else c.encode() for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class ChatLogprobs:
    """choices[i].logprobs of chat completions: {"content": [entry per token]}."""

    def __init__(self, text: TokenText) -> None:
        self._t = text

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self._t.text_of(token), "logprob": _finite(logprob), "bytes": list(self._t.bytes_of(token))}

    def __call__(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._one(e.token, e.logprob)
                            | {"top_logprobs": [self._one(t, lp) for t, lp in e.top]} for e in entries]}


class LegacyLogprobs:
    """choices[i].logprobs of legacy completions. As OpenAI, each `top_logprobs` dict holds the
    top N and the chosen token (so up to N + 1 entries); `text_offset` counts characters from
    the start of the prompt."""

    def __init__(self, text: TokenText, prompt_chars: int) -> None:
        self._t, self._base = text, prompt_chars

    def __call__(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"tokens": [self._t.text_of(e.token) for e in entries],
                "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [self._top(e) for e in entries],
                "text_offset": [self._base + e.offset for e in entries]}

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        top = {self._t.text_of(t): _finite(lp) for t, lp in e.top}
        top.setdefault(self._t.text_of(e.token), _finite(e.logprob))
        return top
