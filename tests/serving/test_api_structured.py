"""Structured output through a real `shardline serve` and the official `openai` client (issue 40):
`chat.completions.parse` with a Pydantic model, json_object, json_schema streamed, llama-server's
`json_schema` and GBNF `grammar` on completions; hostile schemas and grammars are OpenAI 400s
naming the field, and the server keeps serving; /metrics counts constrained requests. On the
paged runner, /metrics and /fleet.json report the KV blocks held (issue 54)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import DEFAULT_SPLIT
from tests.serving.test_api import MODEL, Server
from tests.serving.test_constrained import ASK, PERSON


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float


@pytest.fixture(scope="module", params=["stateful", "paged"])
def server(request: pytest.FixtureRequest, two: Path, shards: Callable[..., Path]) -> Iterator[Server]:
    """The server on the stateful export, then on the paged one (the default model's runner
    since issue 41): the masks ride in its fused ragged steps."""
    folder = two if request.param == "stateful" else shards("gguf", layers=DEFAULT_SPLIT, paged=True)
    s = Server(folder, "--max-streams", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(model=MODEL, messages=_ask("Tell me about Paris."), response_format=City,
                                         max_tokens=80, temperature=0)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"
    assert City.model_validate_json(done.choices[0].message.content or "") == city


def test_json_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=_ask("Give me a recipe."), max_tokens=120,
                                          temperature=0, response_format={"type": "json_object"})
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert (done.choices[0].message.content or "").startswith("{")


def test_json_schema_streamed_equals_whole(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=_ask(ASK), max_tokens=96, temperature=0,
                                           response_format=fmt)
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    parts = client.chat.completions.create(model=MODEL, messages=_ask(ASK), max_tokens=96, temperature=0,
                                           response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == text


def test_completions_json_schema_and_gbnf(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="A person:", max_tokens=96, temperature=0,
                                     extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    gbnf = 'root ::= answer "." \nanswer ::= "yes" | "no"'
    done = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0.9,
                                     seed=3, extra_body={"grammar": gbnf})
    assert done.choices[0].text in ("yes.", "no.")


@pytest.mark.parametrize("endpoint,extra,param,message", [
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "an object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "must be an object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "cannot be compiled"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}},
     "response_format.json_schema.strict", "boolean"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "big", "schema": {"enum": ["x" * (1 << 20)]}}}},
     "response_format", "over the limit"),
    ("completion", {"grammar": "root ::= missing"}, "grammar", "cannot be compiled"),
    ("completion", {"grammar": "root ::= \"a\"", "json_schema": {}}, "grammar", "not several"),
    ("completion", {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema",
     "cannot be compiled"),
])
def test_hostile_constraints_are_400s_naming_the_field(server: Server, client: openai.OpenAI, endpoint: str,
                                                       extra: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    body: Any = e.value.body
    assert body["param"] == param and message in body["message"], body
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_metrics_count_constrained_requests(server: Server, client: openai.OpenAI) -> None:
    before = server.metric("shardline_constrained_requests_total")
    compiles = server.metric("shardline_grammar_compile_seconds_count")
    schema: Any = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"],
                   "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=_ask("A digit?"), max_tokens=12, response_format=fmt)
    assert server.metric("shardline_constrained_requests_total") == before + 2
    assert server.metric("shardline_grammar_compile_seconds_count") == compiles + 1  # the second was cached


def test_the_paged_pool_s_blocks_in_metrics_and_the_fleet(request: pytest.FixtureRequest, server: Server,
                                                          client: openai.OpenAI) -> None:
    """Issue 54 point 7: on the paged runner /metrics reads the pool's blocks held, cached and
    free, and /fleet.json's KV is the blocks held (it was 0 whatever ran); the keyed runner has
    no blocks to report."""
    paged = request.node.callspec.params["server"] == "paged"
    answer = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(answer))  # its prompt is in and it decodes: it holds blocks until its last token, more and more
    held = server.metric('shardline_kv_blocks{state="held"}')
    kv_mb = sum(s["kv_mb"] for s in httpx.get(f"{server.url}/fleet.json").json()["stages"])
    later = server.metric('shardline_kv_blocks{state="held"}')
    total = sum(server.metric(f'shardline_kv_blocks{{state="{s}"}}') for s in ("held", "cached", "free"))
    answer.response.close()
    if not paged:
        assert total == 0 and "shardline_kv_blocks" not in httpx.get(f"{server.url}/metrics").text
        return
    assert 1 <= held <= later < total and server.metric("shardline_kv_block_tokens") == 32
    block_mb = 32 * 30 * 2 * 3 * 64 * 4 / 2**20  # 32 tokens' f32 keys and values in 30 layers
    assert held * block_mb - 0.02 <= kv_mb <= later * block_mb + 0.02


def _format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


# Issue 54's audit: schemas and grammars that compiled and could then not be followed (items 1
# and 3: up to ~10 s of CPU, then a 500 after admission). Each is a 400 naming its field now,
# found before the request is queued; the ids name the trigger.
DEFS_LOOP: Any = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
AUDIT54: list[Any] = [
    pytest.param("completion", {"grammar": 'root ::= x\nx ::= x "a"'}, "grammar", "can never end",
                 id="gbnf-allows-nothing"),
    pytest.param("completion", {"json_schema": DEFS_LOOP}, "json_schema", "no finite value", id="defs-loop"),
    pytest.param("chat", _format(DEFS_LOOP), "response_format", "no finite value", id="defs-loop-response-format"),
    pytest.param("chat", _format({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}),
                 "response_format", "8000 properties", id="8000-integer-properties"),
    pytest.param("chat", _format({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}},
                                             "required": [f"k{i}"]} for i in range(3000)]}),
                 "response_format", "alternatives", id="anyof-3000-objects"),
    pytest.param("completion", {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))}, "grammar",
                 "20000 alternatives", id="gbnf-20000-alternatives"),
    pytest.param("completion", {"grammar": 'root ::= "a"{1000000}'}, "grammar", "1,000,000 terminals",
                 id="gbnf-a-repeated-a-million-times"),
    pytest.param("chat", _format({"type": "string", "pattern": "^a{1000000}$"}), "response_format",
                 "1,000,000 characters", id="pattern-a-million"),
    pytest.param("chat", _format({"type": "string", "pattern": "^((a{100}){100}){100}$"}), "response_format",
                 "1,000,000 characters", id="pattern-nested-counts"),
    pytest.param("chat", _format({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}),
                 "response_format", "no finite value", id="required-self-reference"),
]


def _plain_request_served(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("endpoint,extra,param,message", AUDIT54)
def test_audit54_grammar_is_400_before_admission(server: Server, client: openai.OpenAI, endpoint: str,
                                                 extra: dict[str, Any], param: str, message: str) -> None:
    admitted = server.metric("shardline_constrained_requests_total")
    with pytest.raises(openai.BadRequestError) as e:  # answered (the client waits 120 s at most)
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    body: Any = e.value.body
    assert body["param"] == param and message in body["message"], body
    assert server.metric("shardline_constrained_requests_total") == admitted  # never admitted
    _plain_request_served(client)


def test_audit54_four_hostile_schemas_at_once_are_400s(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def hostile(i: int) -> Any:
        schema = {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(8000)}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=4, extra_body=_format(schema))
        return e.value.body

    with ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(hostile, range(4)))
    assert all(b["param"] == "response_format" for b in bodies), bodies
    _plain_request_served(client)


def test_audit54_an_untyped_self_reference_is_served(client: openai.OpenAI) -> None:
    """The audit's required self-reference without a type is satisfiable (any non-object value
    satisfies it) and the grammar engine follows it 3,000 levels deep: it is served, within its
    schema, never a 500."""
    schema: Any = {"properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    done = client.chat.completions.create(model=MODEL, messages=_ask("Give me JSON."), max_tokens=24,
                                          temperature=0, extra_body=_format(schema))
    if done.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(done.choices[0].message.content or ""), schema)
