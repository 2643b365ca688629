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
- A grammar a stream follows was checked before any request used it (issue 54): a client's
  schema or GBNF against the caps (schema_caps.py, gbnf_caps.py), llguidance's compile under its
  limits, its first mask and a few probed tokens (grammar_probe.py), all within COMPILE_CPU_S of
  the compiling thread's CPU time. A refusal is cached like a grammar, so a repeat costs nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shardline.model.gbnf_caps import check_grammar
from shardline.model.grammar_probe import Vocab, build, probe
from shardline.model.schema_caps import CapError, check_schema

Kind = Literal["json_schema", "lark", "gbnf", "regex"]
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar larger than this is refused before compiling
CACHED = 128  # compiled grammars (and refusals) kept (LRU), by (kind, text)
# CPU seconds one compile may take (checks, llguidance's compile, the probe): the caps keep a
# schema at every cap well under it (BENCHMARKS.md, issue 54); past it the grammar is refused.
COMPILE_CPU_S = 2.0
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
    # The schema the text was written from, when there is one: checked as it is, not parsed again.
    schema: Any = field(default=None, compare=False, hash=False, repr=False)

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema), schema)  # its keys' order is the output's

    def label(self) -> str:
        """What logs call it: its kind, a short prefix and a hash. A grammar is a client's text
        (up to MAX_GRAMMAR_CHARS) and may carry anything: a log line never holds more of it."""
        digest = hashlib.blake2b(self.text.encode(errors="replace"), digest_size=8).hexdigest()
        return f"{self.kind} {self.text[:40]!r}... ({len(self.text)} chars, blake2b {digest})"


class Grammars:
    """Compiles specs against one vocabulary, cached by spec (a refusal too); builds a stream's
    constraint. Thread-safe (the API compiles on its worker threads, the engine advances streams)."""

    def __init__(self, tokenizer_json: str, vocab: int, end_ids: Iterable[int]) -> None:
        self._spec, self.vocab, self.end_ids = tokenizer_json, vocab, sorted(set(end_ids))
        self._tokenizer: Any = None
        self._words: Vocab | None = None
        self._lock = threading.Lock()
        self._copying = threading.Lock()  # one deep copy of a cached matcher at a time
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()  # a matcher, or why it is refused
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

    def words(self) -> Vocab:
        """The probe's view of the vocabulary (model/grammar_probe.py), built once."""
        tokenizer = self.tokenizer()
        with self._lock:
            if self._words is None:
                self._words = Vocab.of(tokenizer, self.vocab, frozenset(self.end_ids))
            return self._words

    def special(self, words: Iterable[str]) -> frozenset[str]:
        """Which of `words` the grammar engine reads as one special token (written bare in Lark,
        not quoted: a special token's bytes never match text)."""
        t = self.tokenizer()
        return frozenset(w for w in words if len(ids := t.tokenize_str(w)) == 1 and t.is_special_token(ids[0]))

    def warm(self) -> None:
        """Build the vocabulary's views now (a thread at start), so the first constrained request
        does not wait for them; a failure here is the first request's to report."""
        with contextlib.suppress(Exception):
            self.words()

    def compile(self, spec: GrammarSpec) -> Any:
        """`spec`'s matcher, checked (caps, limits, its first steps; issue 54) and cached, its
        state before any token: streams follow copies of it (`follow`). Raises GrammarError, the
        same again for a spec refused before."""
        if len(spec.text) > MAX_GRAMMAR_CHARS:  # before the cache: such keys are not kept
            raise GrammarError(f"it is {len(spec.text)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return _matcher(self._cache[spec])
        words = self.words()  # the vocabulary's views first: building them is not the grammar's time
        start, spend = time.perf_counter(), _Spend(COMPILE_CPU_S)
        try:
            compiled: Any = _compiled(spec, self.tokenizer(), words, spend)
        except GrammarError as e:
            compiled = e
        with self._lock:
            self.compile_s += time.perf_counter() - start
            self.compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return _matcher(compiled)

    def follow(self, template: Any, label: str = "a grammar") -> GrammarConstraint:
        """A stream's constraint: its own copy of a compiled matcher (`label`: what logs call it)."""
        with self._copying:
            matcher = template.deep_copy()
        return GrammarConstraint(matcher, self.vocab, frozenset(self.end_ids), label)

    def lazy(self, spec: GrammarSpec, trigger: str) -> LazyConstraint:
        """`spec` once the model writes `trigger` (raises GrammarError now if it cannot compile)."""
        return LazyConstraint(self, spec, trigger)

    def constraint(self, spec: GrammarSpec) -> GrammarConstraint:
        """A fresh matcher for one stream (raises GrammarError)."""
        return self.follow(self.compile(spec), spec.label())


class _Spend:
    """This thread's CPU time since it was made, against a limit: calling it raises GrammarError
    once the limit is spent (between llguidance's calls: one cannot be interrupted)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s, self.start = limit_s, time.thread_time()

    def __call__(self) -> None:
        if time.thread_time() - self.start > self.limit_s:
            raise GrammarError(over_time(self.limit_s))


def over_time(limit_s: float) -> str:
    return f"it takes more than {limit_s:g} s of CPU to compile"


def _matcher(compiled: Any) -> Any:
    if isinstance(compiled, GrammarError):
        raise GrammarError(str(compiled))
    return compiled


def _compiled(spec: GrammarSpec, tokenizer: Any, words: Vocab, spend: _Spend) -> Any:
    """The checked matcher of `spec`: its caps, then llguidance's grammar under its limits,
    then the probe of its first steps, with the CPU time checked between them."""
    try:
        if spec.kind == "json_schema":
            check_schema(spec.schema if spec.schema is not None else json.loads(spec.text))
        elif spec.kind == "gbnf":  # a client's grammar (tools' Lark is written here, their schemas checked)
            check_grammar(spec.text)
        spend()
        matcher = build(tokenizer, _grammar(spec))
        spend()
        probe(matcher, words, spend)
    except CapError as e:
        raise GrammarError(str(e)) from None
    return matcher


def _grammar(spec: GrammarSpec) -> str:
    import llguidance

    try:
        if spec.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS))  # type: ignore[arg-type]
        return str(llguidance.grammar_from(spec.kind, spec.text))
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


class LazyConstraint:
    """A grammar that starts once the model writes `trigger` (tool_choice "auto", as llama-server's
    lazy grammars): until then every token is free; from the token that completes the trigger on,
    the grammar (which begins with the trigger) is fed the trigger and holds what follows."""

    def __init__(self, grammars: Grammars, spec: GrammarSpec, trigger: str) -> None:
        self._grammars, self.trigger = grammars, trigger
        self._trigger_id: int | None = None
        ids = grammars.tokenizer().tokenize_str(trigger)
        if len(ids) == 1 and grammars.tokenizer().is_special_token(ids[0]):
            self._trigger_id = ids[0]
        self._tail = b""  # the end of the text so far, as long as the trigger at most
        self.active: GrammarConstraint | None = None
        self.failure: str | None = None  # decoding/masks.Constraint: set where its masks are computed
        self.label = f"{spec.label()} after {trigger!r}"
        # Compiled now: a grammar that cannot compile is the request's 400, not a failure later;
        # kept here, so starting it on the engine thread is a copy, whatever the cache evicted since.
        self._template = grammars.compile(spec)

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
            self.active = self._grammars.follow(self._template, self.label)
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
