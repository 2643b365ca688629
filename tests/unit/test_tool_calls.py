"""Tool-call syntaxes (issue 40), pure: which one a template teaches (from its text alone), and
what the model wrote read back as text and calls, malformed calls left as text."""

from __future__ import annotations

import json

import pytest

from shardline.model.tool_calls import Call, Harmony, Hermes, Llama3, MistralArgs, MistralList, Parsed, detect

NONE: frozenset[str] = frozenset()


@pytest.mark.parametrize("template,syntax", [
    ("{% for t in tools %}{{ t }}{% endfor %}<tool_call>\n{...}\n</tool_call>", Hermes),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]...[TOOL_CALLS]", MistralList),
    ("[AVAILABLE_TOOLS]...[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}", MistralArgs),
    ('{{- "<|python_tag|>" + tool_call.name }}<|eom_id|>', Llama3),
    ('{"name": function name, "parameters": dictionary of argument name and its value}<|eot_id|>', Llama3),
    ('{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name }}...<|call|>', Harmony),
])
def test_the_template_says_which_syntax(template: str, syntax: type) -> None:
    assert type(detect(template, NONE)) is syntax


def test_a_template_without_tools_has_no_syntax() -> None:
    smollm2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
               "{% endfor %}")
    assert detect(smollm2, NONE) is None


def test_hermes_calls_and_the_text_before_them() -> None:
    raw = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
    parsed = Hermes(NONE).parse(raw)
    assert parsed.content == "Let me look."
    assert parsed.calls == (Call("weather", '{"city": "Paris"}'), Call("time", "{}"))


@pytest.mark.parametrize("raw", [
    "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \n</tool_call>",  # cut JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"w\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "just text",
])
def test_what_is_not_a_call_stays_text(raw: str) -> None:
    parsed = Hermes(NONE).parse(raw)
    assert parsed.calls == () and parsed.content == raw


def test_llama3_json_and_python_tag() -> None:
    assert Llama3(NONE).parse('{"name": "weather", "parameters": {"city": "Oslo"}}').calls == (
        Call("weather", '{"city": "Oslo"}'),)
    assert Llama3(NONE).parse('<|python_tag|>{"name": "f", "parameters": {}}').calls == (Call("f", "{}"),)
    assert Llama3(NONE).parse("The weather is fine.").calls == ()


def test_mistral_list_and_args_forms() -> None:
    raw = 'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    parsed = MistralList(NONE).parse(raw)
    assert parsed.content == "Sure." and [c.name for c in parsed.calls] == ["a", "b"]
    parsed = MistralArgs(NONE).parse('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert parsed.calls == (Call("a", '{"x": 1}'), Call("b", "{}"))
    assert MistralArgs(NONE).parse("[TOOL_CALLS]a[ARGS]{broken").calls == ()


def test_grammars_name_each_function_and_its_parameters() -> None:
    tools = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "time", "parameters": {"type": "object"}}]
    g = Hermes(frozenset({"<tool_call>", "</tool_call>"})).grammar(tools, parallel=False)
    assert g.startswith("start: <tool_call> ") and "</tool_call>" in g and '"const": "weather"' in g
    assert "*" not in g.split("%json")[0]  # one call only
    assert Hermes(NONE).grammar(tools, parallel=True).startswith('start: "<tool_call>" ')
    schema = json.loads(Llama3(NONE).grammar(tools[:1], parallel=False).removeprefix("start: %json "))
    assert schema["required"] == ["name", "parameters"] and schema["properties"]["name"] == {"const": "weather"}


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.weather <|constrain|>json",  # the recipient in the channel
    " to=functions.weather<|channel|>commentary json",  # ... or in the header
])
def test_harmony_calls_in_either_header_order(header: str) -> None:
    raw = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + header + \
          '<|message|>{"city": "Paris"}<|call|>'
    assert Harmony(NONE).parse(raw) == Parsed("", (Call("weather", '{"city": "Paris"}'),))


def test_harmony_reads_the_final_channel_as_content_and_leaves_broken_calls_as_text() -> None:
    raw = ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|end|>'
           "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    parsed = Harmony(NONE).parse(raw)
    assert parsed.content == "Done." and parsed.calls == (Call("a", '{"x": 1}'),)
    broken = "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{broken<|call|>"
    assert Harmony(NONE).parse(broken).calls == ()


def test_a_forced_harmony_call_opens_the_commentary_channel() -> None:
    special = frozenset({"<|channel|>", "<|constrain|>", "<|message|>"})
    g = Harmony(special).forced([{"name": "a", "parameters": {"type": "object"}}], parallel=True)
    assert g.startswith('start: <|channel|> "commentary " "to=functions." (("a" " " <|constrain|> "json" '
                        '<|message|> %json')
    assert "*" not in g.split("%json")[0]  # one call a turn: <|call|> ends it
