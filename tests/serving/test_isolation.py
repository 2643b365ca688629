"""Isolation between requests (issue 54 point 1), on the real default model and real grammars:
a stream whose grammar cannot go on fails alone, with its own reason and nothing of anyone
else's; every stream beside it in the same steps gets exactly the tokens it gets without it. On
the default (paged) runner, with speculation's verify steps, and in the keyed runner's decode
groups, where several streams share one call of every stage and one step's masks."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import llguidance
import numpy as np
import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.grammar import GrammarConstraint, GrammarError, Grammars, GrammarSpec
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.paged_local import PagedPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.conftest import CHAT_PROMPTS, DEFAULT_SPLIT

PLANTED = "PLANTED-b7e1c0de"  # text a bad request carries: it must reach no one else
# The audit's triggers, and one that fails only after its first token (its first mask allows "a").
NOTHING = 'root ::= x\nx ::= x "a"'
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a", "description": PLANTED}
LATER = f'root ::= "a" x\nx ::= x y\ny ::= "{"z" * 30}{PLANTED}"'  # planted past what a log line shows
PLAIN = [*CHAT_PROMPTS, "Name a planet.", "Count to five.", "What is 2 + 2?"]
N = 8


@pytest.fixture(scope="module")
def paged_folder(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers=DEFAULT_SPLIT, paged=True)


@pytest.fixture(scope="module")
def paged_pipe(paged_folder: Path) -> Iterator[PagedPipeline]:
    with PagedPipeline(paged_folder, RunConfig(context=1024), 100 << 20) as p:
        yield p


def _bad(grammars: Grammars) -> list[GrammarConstraint]:
    """The triggers' matchers, built as the engine would hold them but without the API's checks
    (which refuse some of them before admission): the engine must cope with any grammar."""
    specs = [GrammarSpec("gbnf", NOTHING), GrammarSpec.json_schema(LOOP), GrammarSpec("gbnf", LATER)]
    texts = [llguidance.grammar_from("gbnf", NOTHING),
             llguidance.LLMatcher.grammar_from_json_schema(json.dumps(LOOP)), llguidance.grammar_from("gbnf", LATER)]
    return [GrammarConstraint(llguidance.LLMatcher(grammars.tokenizer(), str(t), log_level=0), grammars.vocab,
                              frozenset(grammars.end_ids), spec.label()) for spec, t in zip(specs, texts, strict=True)]


def _run(engine: Engine, requests: list[Request]) -> list[Event]:
    """Every request at once: each one's tokens (as the final event's `top`-free list) and end."""
    import threading

    ends: list[Event | None] = [None] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def on(i: int) -> Callable[[Event], None]:
        def deliver(ev: Event) -> None:
            if ev.token is not None:
                tokens[i].append(ev.token)
            if ev.finish:
                ends[i] = ev
                done[i].set()
        return deliver

    for i, r in enumerate(requests):
        engine.submit(r, on(i))
    for d in done:
        assert d.wait(300)
    return [Event(None, finish=e.finish, error=e.error, cause=e.cause, top=tuple((t, 0.0) for t in tokens[i]))
            for i, e in enumerate(ends) if e is not None]


def _requests(tok: ChatTokenizer, grammars: Grammars, bad: bool) -> list[Request]:
    plain = [Request(tok.encode_chat([{"role": "user", "content": p}]), SamplingConfig(max_tokens=N),
                     frozenset(tok.stop_ids)) for p in PLAIN]
    if not bad:
        return plain
    ask = tok.encode_chat([{"role": "user", "content": f"Say {PLANTED}."}])
    broken = [Request(ask, SamplingConfig(max_tokens=N), frozenset(tok.stop_ids), constraint=c) for c in _bad(grammars)]
    return [*plain[:3], broken[0], *plain[3:6], broken[1], *plain[6:], broken[2]]  # between the plain ones


def _check(got: list[Event], want: list[Event]) -> None:
    plain = [e for e in got if e.cause != "constraint"]
    bad = [e for e in got if e.cause == "constraint"]
    assert [(e.top, e.finish, e.error) for e in plain] == [(e.top, e.finish, "") for e in want]
    assert [e.finish for e in bad] == ["error"] * 3
    assert "NoExtensionBias" in bad[0].error and "NoExtensionBias" in bad[2].error, bad
    assert len(bad[2].top) == 1  # its grammar let it write "a", then could not go on
    for e in bad:  # a reason in a line: not the grammar, not the engine's state
        assert PLANTED not in e.error and "\n" not in e.error and len(e.error) <= 300, e.error


def _alone_and_beside(engine: Callable[[], Engine], tok: ChatTokenizer, grammars: Grammars) -> None:
    e = engine()
    try:
        want = _run(e, _requests(tok, grammars, bad=False))
    finally:
        e.stop()
    e = engine()
    try:
        for _ in range(2):  # and again: nothing of the failures lingers in the engine
            _check(_run(e, _requests(tok, grammars, bad=True)), want)
    finally:
        e.stop()


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "drafts"])
def test_a_broken_grammar_fails_its_stream_alone_on_the_paged_runner(paged_pipe: PagedPipeline, tok: ChatTokenizer,
                                                                    grammars: Grammars, speculate: bool,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Every stream's token is in the same fused ragged step, and the step's masks are computed
    together; the broken ones end with their own reason, the others are untouched. The log
    names each failed grammar by a prefix and a hash, never its whole text."""
    caplog.set_level(logging.INFO, logger="shardline")
    def engine() -> Engine:
        pool = BlockPool(paged_pipe.blocks, paged_pipe.block_size)
        scheduler = PagedScheduler(SchedulerConfig(max_prefills=16), pool)
        drafts = Drafts(LookupDrafter, 4, 4) if speculate else None
        return Engine(paged_pipe, Limits(16, 16), paged_pipe.context, drafts=drafts, scheduler=scheduler)

    _alone_and_beside(engine, tok, grammars)
    failed = [r.getMessage() for r in caplog.records if "cannot go on" in r.getMessage()]
    assert len(failed) == 6 and all("blake2b" in m for m in failed), failed
    assert PLANTED not in caplog.text


def test_a_broken_grammar_fails_its_stream_alone_in_a_decode_group(pipe: LocalPipeline, tok: ChatTokenizer,
                                                                  grammars: Grammars) -> None:
    """The keyed runner: one decode group holds every stream (one call, one step's masks)."""
    def engine() -> Engine:
        return Engine(pipe, Limits(16, 16), 8192, SchedulerConfig(groups=1, compact_at=8))

    _alone_and_beside(engine, tok, grammars)


def test_the_triggers_are_real(grammars: Grammars) -> None:
    """What the engine meets above: two grammars that cannot say what comes first, and one that
    allows a first token and nothing after it."""
    nothing, loop, later = _bad(grammars)
    for c in (nothing, loop):
        with pytest.raises(GrammarError, match="^NoExtensionBias$"):
            c.masks([])
    first = later.masks([])[0]
    allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))
    assert allowed.size
    later.advance(int(allowed[0]))
    with pytest.raises(GrammarError, match="^NoExtensionBias$"):
        later.masks([])
