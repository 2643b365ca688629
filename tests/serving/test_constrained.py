"""Constrained decoding on the real default model (issue 40): the output parses and validates
against its schema whatever the model would have said; greedy constrained output is the same with
speculation (drafts that break the grammar cut) and without, alone and in a decode group beside
unconstrained rows, whose tokens the masks do not touch."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from shardline.config import SamplingConfig, SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.model.grammar import Grammars, GrammarSpec
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts, SpecStats

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
ASK = "Describe a programmer as JSON with their name, age and languages."
N = 96


@pytest.fixture(scope="module")
def prompt(tok: ChatTokenizer) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": ASK}])


class Junk:
    """A drafter whose drafts mostly break the grammar: a newline run, then the lookup's own."""

    cost_s = 0.0

    def __init__(self, junk: list[int]) -> None:
        self.lookup = LookupDrafter()
        self.junk = junk

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        found = self.lookup.propose(context, k, params).tokens
        return Proposal((self.junk + found)[:k] if len(context) % 2 else (found + self.junk)[:k])

    def ready(self, context: list[int]) -> int:
        return 8

    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool:
        return False

    def close(self) -> None:
        pass


def _run(engine: Engine, requests: list[Request], stats: list[SpecStats | None] | None = None,
         ) -> list[tuple[list[int], str]]:
    """Every request at once; each one's tokens and finish reason (and speculation's figures)."""
    out: list[tuple[list[int], str]] = [([], "")] * len(requests)
    done = [threading.Event() for _ in requests]

    def collect(i: int) -> object:
        tokens: list[int] = []

        def on(ev: Event) -> None:
            if ev.token is not None:
                tokens.append(ev.token)
            if ev.finish:
                out[i] = (tokens, ev.finish + (f": {ev.error}" if ev.error else ""))
                if stats is not None:
                    stats[i] = ev.spec
                done[i].set()
        return on

    for i, r in enumerate(requests):
        engine.submit(r, collect(i))
    for d in done:
        assert d.wait(300)
    return out


def _request(prompt: list[int], tok: ChatTokenizer, grammars: Grammars | None, schema: dict[str, object] | None = None,
             speculative: bool = True) -> Request:
    constraint = grammars.constraint(GrammarSpec.json_schema(schema)) if grammars and schema else None
    return Request(prompt, SamplingConfig(max_tokens=N), frozenset(tok.stop_ids), speculative, constraint=constraint)


def _engine(pipe: LocalPipeline, groups: int, drafts: Drafts | None = None) -> Engine:
    return Engine(pipe, Limits(4, 4), 8192, SchedulerConfig(groups=groups, compact_at=8), drafts)


def test_output_validates_and_ends_where_the_schema_does(pipe: LocalPipeline, tok: ChatTokenizer,
                                                         grammars: Grammars, prompt: list[int]) -> None:
    engine = _engine(pipe, 0)
    try:
        [(free, _), (tokens, finish)] = _run(engine, [_request(prompt, tok, None),
                                                      _request(prompt, tok, grammars, PERSON)])
    finally:
        engine.stop()
    text = tok.decode(tokens)
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"  # the grammar completed, then the model's end of turn
    with pytest.raises(json.JSONDecodeError):  # unconstrained, this model does not answer in JSON
        json.loads(tok.decode(free))


@pytest.mark.parametrize("groups", [0, 1], ids=["alone", "group"])
def test_speculation_and_groups_change_no_token(pipe: LocalPipeline, tok: ChatTokenizer, grammars: Grammars,
                                                prompt: list[int], groups: int) -> None:
    """Greedy constrained output equals itself without speculation; in a decode group beside an
    unconstrained stream, each row gets what it gets alone."""
    other = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    plain = _engine(pipe, 0)
    try:
        [(want, _)] = _run(plain, [_request(prompt, tok, grammars, PERSON, speculative=False)])
        [(free, _)] = _run(plain, [_request(other, tok, None, speculative=False)])
    finally:
        plain.stop()
    junk = tok.tokens("\n\n }}")
    spec = _engine(pipe, groups, Drafts(lambda: Junk(junk), 4, 8))
    stats: list[SpecStats | None] = [None, None]
    try:
        got = _run(spec, [_request(prompt, tok, grammars, PERSON), _request(other, tok, None)], stats)
    finally:
        spec.stop()
    assert [t for t, _ in got] == [want, free]
    assert stats[0] is not None and stats[0].drafted > 0  # drafts within the grammar were verified


def test_a_bad_schema_does_not_compile(grammars: Grammars) -> None:
    from shardline.model.grammar import GrammarError

    with pytest.raises(GrammarError):
        grammars.constraint(GrammarSpec.json_schema({"type": "no-such-type"}))
    with pytest.raises(GrammarError, match="over the limit"):
        grammars.constraint(GrammarSpec("json_schema", json.dumps({"enum": ["x" * 300_000]})))


@pytest.mark.parametrize("lark,says", [
    ('start: x\nx: x "a"', "it can never produce a token: NoExtensionBias"),
    ('start: "a"~1000000', "an output starting 'aaaa"),
    ("start: " + " | ".join(f'"w{i}"' for i in range(3000)), "Current row has 3001 items"),
])
def test_a_grammar_that_cannot_be_followed_is_refused_by_its_probe(grammars: Grammars, lark: str, says: str) -> None:
    """Lark (written by the server for tools) skips the caps: what refuses these is llguidance
    itself, on the first mask or a few tokens down a probed path (model/grammar_probe.py)."""
    from shardline.model.grammar import GrammarError

    with pytest.raises(GrammarError, match=re.escape(says)):
        grammars.compile(GrammarSpec("lark", lark))
    compiled = grammars.compiled
    with pytest.raises(GrammarError, match=re.escape(says)):  # the refusal is cached: no second compile
        grammars.compile(GrammarSpec("lark", lark))
    assert grammars.compiled == compiled


def test_a_compile_over_its_cpu_time_is_refused(grammars: Grammars, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardline.model import grammar
    from shardline.model.grammar import GrammarError

    monkeypatch.setattr(grammar, "COMPILE_CPU_S", 0.0)
    with pytest.raises(GrammarError, match="more than 0 s of CPU to compile"):
        grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}))


def test_the_paged_runner_gives_the_same_constrained_tokens(pipe: LocalPipeline, tok: ChatTokenizer,
                                                            grammars: Grammars, prompt: list[int],
                                                            shards: Callable[..., Path]) -> None:
    """The default runner (issue 41): a constrained stream's masks ride in the fused ragged step
    beside an unconstrained stream's token and both streams' drafts (most of them breaking the
    grammar). Greedy, each stream gets the stateful engine's tokens, and drafts were verified."""
    from shardline.config import RunConfig
    from shardline.pipeline.paged_local import PagedPipeline
    from shardline.serving.kv_blocks import BlockPool
    from shardline.serving.paged_scheduler import PagedScheduler
    from tests.conftest import DEFAULT_SPLIT

    other = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    plain = _engine(pipe, 0)
    try:
        want = [t for t, _ in _run(plain, [_request(prompt, tok, grammars, PERSON, speculative=False),
                                           _request(other, tok, None, speculative=False)])]
    finally:
        plain.stop()
    paged = PagedPipeline(shards("gguf", layers=DEFAULT_SPLIT, paged=True), RunConfig(), 400 << 20)
    scheduler = PagedScheduler(SchedulerConfig(), BlockPool(paged.blocks, paged.block_size))
    engine = Engine(paged, Limits(4, 4), paged.context, drafts=Drafts(lambda: Junk(tok.tokens("\n\n }}")), 4, 8),
                    scheduler=scheduler)
    stats: list[SpecStats | None] = [None, None]
    try:
        got = _run(engine, [_request(prompt, tok, grammars, PERSON), _request(other, tok, None)], stats)
    finally:
        engine.shutdown()
        paged.shutdown()
    assert [t for t, _ in got] == want
    jsonschema.validate(json.loads(tok.decode(want[0])), PERSON)
    assert stats[0] is not None and stats[0].drafted > 0
