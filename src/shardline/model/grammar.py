"""Grammar-constrained decoding on the coordinator, with llguidance (issue 40).

Why llguidance (bench/structured.py measures the three engines on PyPI with CPU wheels): it
computes a token mask lazily per step (~40 us median on Qwen2.5's 151,936 tokens, no
per-schema index over the vocabulary to build first), compiles a JSON schema in about a
millisecond, takes JSON schema, Lark, GBNF (llama.cpp's grammars) and regexes, rolls back
(speculation's rejected drafts), and needs nothing but its wheel. xgrammar requires torch,
triton and transformers at run time; outlines-core builds an index over the whole vocabulary
per schema before the first token.

Invariants:
- A `GrammarConstraint` holds the state after exactly the tokens its stream emitted: masks for a
  verify step's drafts are computed by consuming them and rolling back.
- The mask lets the model end (its end-of-turn tokens) only where the grammar is complete.
- Nothing here runs on a worker: steps carry the masks (decoding/masks.py). It lives beside the
  tokenizer because it is compiled against the model's vocabulary, where the API can reach it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Kind = Literal["json_schema", "lark", "gbnf", "regex"]
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar larger than this is refused before compiling
CACHED = 128  # compiled grammars kept (LRU), by (kind, text)
# Compact JSON with the separators people read (as json.dumps writes it): free whitespace lets a
# small model pad forever between tokens the schema allows.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile or follow (the message says why)."""


def _stopped(matcher: Any) -> str:
    """Why a matcher stopped, in a line: llguidance's message goes on with the matcher's state
    and the whole grammar, which belong in no reply and no log."""
    lines = str(matcher.get_error()).strip().splitlines()
    first = lines[0] if lines else "the grammar engine stopped"
    return first[:200] + ("..." if len(first) > 200 else "")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to."""

    kind: Kind
    text: str  # the JSON schema (as JSON text), or the grammar's source

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema))  # its keys' order is the output's

    def label(self) -> str:
        """What logs call it: its kind, a short prefix and a hash. A grammar is a client's text
        (up to MAX_GRAMMAR_CHARS) and may carry anything: a log line never holds more of it."""
        digest = hashlib.blake2b(self.text.encode(errors="replace"), digest_size=8).hexdigest()
        return f"{self.kind} {self.text[:40]!r}... ({len(self.text)} chars, blake2b {digest})"


class Grammars:
    """Compiles specs against one vocabulary, cached by spec; builds a stream's constraint.
    Thread-safe (the API compiles on its worker threads, the engine advances streams)."""

    def __init__(self, tokenizer_json: str, vocab: int, end_ids: Iterable[int]) -> None:
        self._spec, self.vocab, self.end_ids = tokenizer_json, vocab, sorted(set(end_ids))
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, str] = OrderedDict()
        self.compile_s = 0.0  # total seconds spent compiling (cache misses)
        self.compiled = 0

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once: ~2 s for 151,936 tokens)."""
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._spec, n_vocab=self.vocab, eos_token=self.end_ids)
                except (ValueError, RuntimeError) as e:
                    raise GrammarError(f"the grammar engine cannot read this tokenizer: {e}") from None
                # Built once: its JSON text (6.6 MB as a str for the default model) is not needed again.
                self._spec = ""
            return self._tokenizer

    def special(self, words: Iterable[str]) -> frozenset[str]:
        """Which of `words` the grammar engine reads as one special token (written bare in Lark,
        not quoted: a special token's bytes never match text)."""
        t = self.tokenizer()
        return frozenset(w for w in words if len(ids := t.tokenize_str(w)) == 1 and t.is_special_token(ids[0]))

    def warm(self) -> None:
        """Build the vocabulary's view now (a thread at start), so the first constrained request
        does not wait for it; a failure here is the first request's to report."""
        with contextlib.suppress(Exception):
            self.tokenizer()

    def compile(self, spec: GrammarSpec) -> str:
        """The validated grammar of `spec` (cached). Raises GrammarError."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"it is {len(spec.text)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
        start = time.perf_counter()
        grammar = _grammar(spec)
        _validate(grammar, self.tokenizer())
        with self._lock:
            self.compile_s += time.perf_counter() - start
            self.compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return grammar

    def lazy(self, spec: GrammarSpec, trigger: str) -> LazyConstraint:
        """`spec` once the model writes `trigger` (raises GrammarError now if it cannot compile)."""
        return LazyConstraint(self, spec, trigger)

    def constraint(self, spec: GrammarSpec) -> GrammarConstraint:
        """A fresh matcher for one stream (raises GrammarError)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(_stopped(matcher))
        return GrammarConstraint(matcher, self.vocab, frozenset(self.end_ids), spec.label())


def _grammar(spec: GrammarSpec) -> str:
    import llguidance

    try:
        if spec.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS))  # type: ignore[arg-type]
        return str(llguidance.grammar_from(spec.kind, spec.text))
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


def _validate(grammar: str, tokenizer: Any) -> None:
    import llguidance

    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        raise GrammarError(messages[0] if messages else "invalid grammar")


class LazyConstraint:
    """A grammar that starts once the model writes `trigger` (tool_choice "auto", as llama-server's
    lazy grammars): until then every token is free; from the token that completes the trigger on,
    the grammar (which begins with the trigger) is fed the trigger and holds what follows."""

    def __init__(self, grammars: Grammars, spec: GrammarSpec, trigger: str) -> None:
        self._grammars, self._spec, self.trigger = grammars, spec, trigger
        self._trigger_id: int | None = None
        ids = grammars.tokenizer().tokenize_str(trigger)
        if len(ids) == 1 and grammars.tokenizer().is_special_token(ids[0]):
            self._trigger_id = ids[0]
        self._tail = b""  # the end of the text so far, as long as the trigger at most
        self.active: GrammarConstraint | None = None
        self.failure: str | None = None  # decoding/masks.Constraint: set where its masks are computed
        self.label = f"{spec.label()} after {trigger!r}"
        grammars.compile(spec)  # a grammar that cannot compile is the request's 400, not a failure later

    def masks(self, drafts: list[int]) -> np.ndarray | None:
        return self.active.masks(drafts) if self.active is not None else None

    def valid(self, drafts: list[int]) -> int:
        """Drafts up to the one that completes the trigger: positions after it would need the
        grammar, which starts only once that token is the stream's."""
        if self.active is not None:
            return self.active.valid(drafts)
        tail = self._tail
        for i, d in enumerate(drafts):
            found, tail = self._seen(tail, d)
            if found is not None:
                return i + 1
        return len(drafts)

    def advance(self, token: int) -> None:
        if self.active is not None:
            self.active.advance(token)
            return
        found, self._tail = self._seen(self._tail, token)
        if found is not None:
            self.active = self._grammars.constraint(self._spec)
            self.active.feed(found)

    def ends(self, token: int) -> bool:
        return self.active is not None and self.active.ends(token)

    def _seen(self, tail: bytes, token: int) -> tuple[list[int] | None, bytes]:
        """Whether `token` completes the trigger after `tail` (then the tokens that spell the
        trigger and what of this token follows it), and the new tail."""
        if self._trigger_id is not None:
            return ([token] if token == self._trigger_id else None), b""
        want = self.trigger.encode()
        text = tail + bytes(self._grammars.tokenizer().decode_bytes([token]))
        at = text.find(want)
        if at < 0:
            return None, text[-(len(want) - 1):] if len(want) > 1 else b""
        rest = text[at:]  # the trigger and what the same token wrote after it
        return list(self._grammars.tokenizer().tokenize_bytes(rest)), b""


class GrammarConstraint:
    """One stream's grammar state (it is a decoding/masks.Constraint)."""

    def __init__(self, matcher: Any, vocab: int, end_ids: frozenset[int], label: str = "a grammar") -> None:
        self._m, self.vocab, self.end_ids, self.label = matcher, vocab, end_ids, label
        self.failure: str | None = None  # decoding/masks.Constraint: set where its masks are computed

    def masks(self, drafts: list[int]) -> np.ndarray:
        out = np.empty((len(drafts) + 1, (self.vocab + 31) // 32), np.int32)  # decoding/masks.py's layout
        self._fill(out[0])
        consumed = 0
        for i, d in enumerate(drafts):
            if not self._m.consume_token(d):  # drafts were cut by `valid`: not reached
                raise GrammarError(f"draft {d} breaks the grammar: {_stopped(self._m)}")
            consumed += 1
            self._fill(out[i + 1])
        if consumed:
            self._m.rollback(consumed)
        return out

    def valid(self, drafts: list[int]) -> int:
        return int(self._m.validate_tokens(list(drafts))) if drafts else 0

    def feed(self, tokens: list[int]) -> None:
        """What the model already wrote of the grammar (a lazy grammar's trigger), however it
        was tokenized: the grammar reads bytes."""
        if not self._m.consume_tokens(tokens):
            raise GrammarError(f"the grammar does not start with what was written: {_stopped(self._m)}")

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} is outside the grammar: {_stopped(self._m)}")

    def ends(self, token: int) -> bool:
        """`token` closes the output: an end-of-turn token where the grammar is complete."""
        return token in self.end_ids and bool(self._m.is_accepting())

    def _fill(self, row: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
        if self._m.is_error():
            raise GrammarError(_stopped(self._m))
