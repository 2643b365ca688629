"""Every tool-call syntax's grammar against its own parser, on the default model's vocabulary
(issue 40): what the grammar lets a model write parses back into the call it constrained.

- Lazy (`auto`): a call as the family's model writes it, fed token by token after free text, is
  allowed by each mask once the trigger is written, ends where the grammar accepts, and parses.
- Forced (`required`): greedy decoding of the real model under each syntax's grammar gives one
  call of an offered function with arguments valid against its parameters.

The default model's vocabulary has none of these families' markers as special tokens, so the
grammars spell them as text; what is tested is the grammar and the parser agreeing."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from shardline.config import SamplingConfig
from shardline.model.grammar import Grammars, GrammarSpec
from shardline.model.tokenizer import ChatTokenizer
from shardline.model.tool_calls import MARKERS, Harmony, Hermes, Llama3, MistralArgs, MistralList, ToolSyntax
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"name": "weather", "parameters": WEATHER},
         {"name": "clock", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                          "properties": {"zone": {"enum": ["UTC", "CET"]}}}}]
ARGS = '{"city": "Paris", "days": 3}'

# (syntax, what the model writes before the call, the call from its trigger on)
WRITTEN = [
    (Hermes, "Let me look.\n", '<tool_call>\n{"name": "weather", "arguments": ' + ARGS + "}\n</tool_call>"),
    (Llama3, "", '{"name": "weather", "parameters": ' + ARGS + "}"),
    (MistralList, "Sure.", '[TOOL_CALLS][{"name": "weather", "arguments": ' + ARGS + "}]"),
    (MistralArgs, "", "[TOOL_CALLS]weather[ARGS]" + ARGS),
    (Harmony, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary ",
     "to=functions.weather <|constrain|>json<|message|>" + ARGS),
]


def _allowed(bits: object, token: int) -> bool:
    row = bits[0]  # type: ignore[index]
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("kind,before,call", WRITTEN, ids=[w[0].name for w in WRITTEN])
def test_a_call_as_the_model_writes_it_passes_the_lazy_grammar_and_parses(
        tok: ChatTokenizer, grammars: Grammars, kind: type[ToolSyntax], before: str, call: str) -> None:
    syntax = kind(grammars.special(MARKERS))
    c = grammars.lazy(GrammarSpec("lark", syntax.grammar(TOOLS, parallel=False)), syntax.trigger)
    tokens = tok.tokens(before + call)
    for t in tokens:
        bits = c.masks([])
        assert bits is None or _allowed(bits, t), f"{tok.raw.decode([t])!r} refused in {kind.name}"
        c.advance(t)
    assert c.active is not None  # the trigger was seen: the call was held to the grammar
    assert c.ends(tok.eos_id)  # complete: the end of turn may follow
    parsed = syntax.parse(tok.raw.decode(tokens, skip_special_tokens=False))
    assert [(x.name, json.loads(x.arguments)) for x in parsed.calls] == [("weather", json.loads(ARGS))]


@pytest.mark.parametrize("kind", [w[0] for w in WRITTEN], ids=[w[0].name for w in WRITTEN])
def test_a_wrong_argument_is_refused_after_the_trigger(tok: ChatTokenizer, grammars: Grammars,
                                                       kind: type[ToolSyntax]) -> None:
    syntax = kind(grammars.special(MARKERS))
    c = grammars.constraint(GrammarSpec("lark", syntax.grammar(TOOLS, parallel=False)))
    _, _, call = next(w for w in WRITTEN if w[0] is kind)
    bad = call.replace('"Paris"', '"Oslo"')
    assert c.valid(tok.tokens(bad)) < len(tok.tokens(bad))


def _generate(pipe: LocalPipeline, tok: ChatTokenizer, request: Request) -> list[int]:
    engine = Engine(pipe, Limits(4, 4), 8192, SchedulerConfig(groups=0))
    tokens: list[int] = []
    done = threading.Event()

    def on(ev: Event) -> None:
        if ev.token is not None:
            tokens.append(ev.token)
        if ev.finish:
            done.set()
    try:
        engine.submit(request, on)
        assert done.wait(300)
    finally:
        engine.stop()
    return tokens


@pytest.mark.parametrize("kind", [w[0] for w in WRITTEN], ids=[w[0].name for w in WRITTEN])
def test_required_calls_from_the_real_model_parse_and_validate(pipe: LocalPipeline, tok: ChatTokenizer,
                                                               grammars: Grammars, kind: type[ToolSyntax]) -> None:
    syntax = kind(grammars.special(MARKERS))
    constraint = grammars.constraint(GrammarSpec("lark", syntax.forced(TOOLS, parallel=False)))
    prompt = tok.encode_chat([{"role": "user", "content": "What is the weather in Paris for three days?"}])
    tokens = _generate(pipe, tok, Request(prompt, SamplingConfig(max_tokens=96), frozenset(tok.stop_ids), False,
                                          constraint=constraint))
    parsed = syntax.parse(tok.raw.decode(tokens, skip_special_tokens=False))
    assert len(parsed.calls) == 1, tok.raw.decode(tokens, skip_special_tokens=False)
    params = {t["name"]: t["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(parsed.calls[0].arguments), params[parsed.calls[0].name])
