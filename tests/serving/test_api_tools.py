"""Tools through a real `shardline serve` (the default model, with the built-in chatml-tools
template) and the official `openai` client, then an agent framework nobody here wrote
(openai-agents): calls are well formed and their arguments valid against their function's
parameters (constrained decoding), whatever the small model's judgement; streamed calls equal
whole ones; a tool's result goes back by its call id; hostile tools and choices are 400s."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import DEFAULT_SPLIT
from tests.serving.test_api import MODEL, Server

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME: Any = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module", params=["stateful", "paged"])
def server(request: pytest.FixtureRequest, two: Path, shards: Callable[..., Path]) -> Iterator[Server]:
    """The server on the stateful export, then on the paged one (the default model's runner
    since issue 41): a tool call's lazy grammar rides in its fused ragged steps."""
    folder = two if request.param == "stateful" else shards("gguf", layers=DEFAULT_SPLIT, paged=True)
    s = Server(folder, "--max-streams", "4", "--chat-template", "chatml-tools")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each call well formed, its arguments valid for its function: (name, arguments) each."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_required_gives_valid_calls(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=120, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert _valid(choice.message.tool_calls)


def test_a_named_function_once(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}},
                                          parallel_tool_calls=False)
    calls = _valid(done.choices[0].message.tool_calls)
    assert [name for name, _ in calls] == ["get_time"]


def test_streamed_calls_equal_whole_ones(client: openai.OpenAI) -> None:
    args: Any = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
                 "temperature": 0}
    whole = _valid(client.chat.completions.create(**args).choices[0].message.tool_calls)
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [d.index for d in deltas] == list(range(len(whole)))
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == whole


def test_a_tool_loop(client: openai.OpenAI) -> None:
    """A call, its result sent back under its id, then the model's next turn (auto: text, or a
    call that is then constrained as soon as it starts)."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0).choices[0].message
    assert first.tool_calls
    messages: Any = [*ASK, first.model_dump(exclude_none=True),
                     *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": "sunny, 21 C"})}
                       for c in first.tool_calls)]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60,
                                            temperature=0).choices[0]
    assert second.finish_reason in ("stop", "length", "tool_calls")
    if second.message.tool_calls:
        _valid(second.message.tool_calls)
    else:
        assert second.message.content and "<tool_call>" not in second.message.content


def test_auto_calls_are_well_formed_when_the_model_makes_them(client: openai.OpenAI) -> None:
    asks = ["What is the weather in Paris right now?", "Tell me a joke.", "What time is it in Tokyo?"]
    for text in asks:
        msg = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], tools=TOOLS,
                                             max_tokens=80, temperature=0).choices[0].message
        if msg.tool_calls:
            _valid(msg.tool_calls)


@pytest.mark.parametrize("extra,param,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_hostile_tools_are_400s(server: Server, client: openai.OpenAI, extra: dict[str, Any], param: str,
                                message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    body: Any = e.value.body
    assert body["param"] == param and message in body["message"], body


@pytest.mark.parametrize("messages,param", [
    ([*ASK, {"role": "tool", "tool_call_id": "call_unknown", "content": "x"}], "messages[1].tool_call_id"),
    ([*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "get_time", "arguments": "{not json"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*ASK, {"role": "user", "content": "x", "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[1].tool_calls"),
])
def test_a_conversation_that_does_not_add_up_is_a_400(client: openai.OpenAI, messages: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == param  # type: ignore[index]


def _function(name: str, parameters: Any) -> Any:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _plain_request_served(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("tools,says", [
    pytest.param([WEATHER, _function("loop", {"type": "object", "properties": {"x": {"$ref": "#"}},
                                              "required": ["x"]})], "loop's parameters: no finite value",
                 id="required-self-reference"),
    pytest.param([_function("big", {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                     for i in range(8000)}})],
                 "big's parameters: the object at # has 8000 properties", id="8000-integer-properties"),
    pytest.param([_function(f"t{j}", {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                       for i in range(300)}}) for j in range(4)],
                 "t3's parameters: more than 1000 properties in all", id="tools-share-the-caps"),
    pytest.param([_function("p", {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}},
                                  "required": ["s"]})], "1,000,000 characters", id="pattern-a-million"),
])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_audit54_tool_parameters_that_cannot_be_followed_are_400s(client: openai.OpenAI, tools: Any, says: str,
                                                                  choice: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=4)
    body: Any = e.value.body
    assert body["param"] == "tools" and says in body["message"], body
    _plain_request_served(client)


def test_audit54_deep_tool_call_arguments_are_a_400(client: openai.OpenAI) -> None:
    """2,000 levels in a call's arguments (a 16 KiB body) were a RecursionError and a 500."""
    args = '{"a": ' * 2000 + "1" + "}" * 2000
    messages: Any = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": args}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    body: Any = e.value.body
    assert body["param"] == "messages[1].tool_calls[0].function.arguments", body
    assert "nested deeper than 64 levels" in body["message"]
    _plain_request_served(client)


def test_an_agent_framework_runs_a_two_tool_task(server: Server) -> None:
    """openai-agents (from PyPI) drives the server as it would OpenAI's: it calls both tools with
    valid arguments, sends their results back, and the run ends."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no network: nothing is exported
    seen: list[tuple[str, dict[str, Any]]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(("get_weather", {"city": city}))
        return f"It is sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        seen.append(("get_time", {"city": city}))
        return f"It is 10:00 in {city}."

    async def runs() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        out = []
        for tool in (get_weather, get_time):  # each run must first call the tool named, then may answer
            agent = Agent(name="helper", instructions="Answer with the tools.", model=model,
                          tools=[get_weather, get_time],
                          model_settings=ModelSettings(tool_choice=tool.name, temperature=0, max_tokens=60))
            out.append(await Runner.run(agent, "What are the weather and the time in Paris?", max_turns=3))
        await client.close()
        return out

    run = asyncio.run(runs())
    assert [name for name, _ in seen[:1]] == ["get_weather"] and "get_time" in [n for n, _ in seen]
    for name, args in seen:
        assert isinstance(args["city"], str) and name in ("get_weather", "get_time")
    assert all(isinstance(r.final_output, str) for r in run)
