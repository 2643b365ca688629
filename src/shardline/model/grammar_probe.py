"""A grammar's matcher built within llguidance's limits, then its first steps tried before any
request is admitted with it (issue 54).

Some grammars compile and cannot be followed: the parser's limits (items in a row, items per
step) are met only once a token is consumed (an `anyOf` of 3,000 objects fails on the first `{`,
`"a"{1000000}` on the first `a`), or the grammar allows no token at all (`root ::= x`,
`x ::= x "a"`: the first mask is an error). Admitted, such a stream failed mid-answer. The probe
computes the first mask and then walks a few tokens down two paths per kind of first byte (`{`,
`[`, `"`, a digit...: what a model may start with): one taking the shortest allowed token each
step, one the longest (what the parser must predict depends on where a token ends), and refuses
the grammar on the first error or dead end; a path that reaches an accepting state ends early.
It proves nothing about the paths it did not take: the engine still ends a stream whose grammar
fails later with an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardline.model.schema_caps import CapError

# llguidance's LLParserLimits: its defaults but for these. The grammar size bounds the work of
# building the lexer and parser tables from a grammar that passed the caps (a schema at every
# cap builds well under it); errors without the parser's state, which repeats the grammar.
MAX_GRAMMAR_SIZE = 100_000
PROBE_KINDS = 16  # kinds of first byte probed (punctuation first), two paths each
PROBE_STEPS = 8  # tokens walked down each path after its first
_EMPTY = 256  # the "first byte" of a token that spells nothing (a special token)


def limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)


def reason(matcher: Any) -> str:
    """llguidance's error, its first line (the rest is a marker)."""
    return str(matcher.get_error()).split("\n", 1)[0]


@dataclass(frozen=True)
class Vocab:
    """What the probe reads of the vocabulary: each token's bytes, length and first byte."""

    words: list[bytes]
    shortest: np.ndarray  # a sort key per token: its length (one that spells nothing sorts last)
    longest: np.ndarray  # minus its length (one that spells nothing sorts last)
    firsts: np.ndarray
    end_ids: frozenset[int]

    @staticmethod
    def of(tokenizer: Any, size: int, end_ids: frozenset[int]) -> Vocab:
        words = [bytes(tokenizer.decode_bytes([i])) for i in range(size)]
        lengths = np.array([len(w) for w in words], np.int64)
        firsts = np.array([w[0] if w else _EMPTY for w in words], np.int64)
        return Vocab(words, np.where(lengths > 0, lengths, 1 << 20), -lengths, firsts, end_ids)


def build(tokenizer: Any, grammar: str) -> Any:
    """A matcher for `grammar` under the limits; CapError with llguidance's reason."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise CapError(reason(matcher))
    return matcher


def probe(template: Any, vocab: Vocab, spend: Callable[[], None]) -> None:
    """CapError if the grammar of `template` allows no token, or fails or dead-ends on a probed
    path; `spend()` is called before each step (it raises once the time is spent).

    The first mask is computed on `template` itself, and every path (and every stream after)
    starts from a copy of it: llguidance computes a mask with the GIL released, but a token
    consumed before its mask makes it compute the mask inside the call, holding the GIL (48 ms
    for an anyOf of 1,000 objects: the engine thread and the event loop stood still)."""
    first = _allowed(template, vocab, b"")
    for key in (vocab.shortest, vocab.longest):
        for token in _openers(first, vocab, key):
            spend()
            _walk(template.deep_copy(), token, vocab, key, spend)


def _allowed(m: Any, vocab: Vocab, written: bytes) -> np.ndarray:
    """The tokens `m` allows next (ids), after `written`; CapError when there are none."""
    words = (len(vocab.words) + 31) // 32
    row = np.zeros(words, np.int32)
    m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    if m.is_error():
        raise CapError(_where(written, f"it can never produce a token: {reason(m)}" if not written else reason(m)))
    ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: len(vocab.words)])
    if not ids.size and not m.is_accepting():
        raise CapError(_where(written, "it allows no token"))
    return ids


def _openers(ids: np.ndarray, vocab: Vocab, key: np.ndarray) -> list[int]:
    """The first allowed token by `key` of each kind of first byte, at most PROBE_KINDS: ASCII
    punctuation first (where structure starts), then letters and digits (all digits one kind),
    then the rest."""
    ids = _ends_out(ids, vocab)
    ids = ids[np.argsort(key[ids], kind="stable")]
    firsts = vocab.firsts[ids]
    firsts = np.where((firsts >= ord("0")) & (firsts <= ord("9")), ord("0"), firsts)
    kinds, at = np.unique(firsts, return_index=True)  # each kind's first token by `key`
    rank = [(0 if b < 128 and not chr(b).isalnum() else 1 if b < 128 else 2, i) for i, b in enumerate(kinds)]
    return [int(ids[at[i]]) for _, i in sorted(rank)[:PROBE_KINDS]]


def _ends_out(ids: np.ndarray, vocab: Vocab) -> np.ndarray:
    return ids[~np.isin(ids, list(vocab.end_ids))] if vocab.end_ids else ids


def _walk(m: Any, token: int, vocab: Vocab, key: np.ndarray, spend: Callable[[], None]) -> None:
    written = b""
    for _ in range(PROBE_STEPS):
        written += vocab.words[token]
        if not m.consume_token(token):
            raise CapError(_where(written, reason(m)))
        if m.is_accepting():
            return
        spend()
        ids = _ends_out(_allowed(m, vocab, written), vocab)
        if not ids.size:
            return  # only an end: it is complete
        token = int(ids[np.argmin(key[ids])])  # the first by `key`, the lowest id of those


def _where(written: bytes, what: str) -> str:
    if not written:
        return what
    return f"it cannot be followed: an output starting {written[:40].decode(errors='replace')!r} fails: {what}"
