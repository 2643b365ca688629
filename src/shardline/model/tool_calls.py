"""Pure: the tool-call syntax a chat template teaches its model, chosen from the template's own
text (never the model's name), as a grammar for the call and a parser for what the model wrote.

- Hermes (Qwen2.5, Qwen3, SmolLM3, shardline's chatml-tools): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after optional text.
- Llama 3.x: the answer is one JSON object `{"name": ..., "parameters": {...}}` (built-in tools
  after `<|python_tag|>`).
- Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 templates), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (templates that know `[ARGS]`).
- Harmony (gpt-oss): a call is a commentary message addressed to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (or the recipient in
  the header: ` to=functions.NAME<|channel|>commentary json<|message|>`), and the turn ends at
  `<|call|>`, a stop token: one call per turn.

Each syntax gives a Lark grammar (llguidance's, with `%json` for the arguments' schemas) of one
call or several, what starts a call (its trigger: `auto` constrains only once the model writes
it), and the parse of the raw output (special tokens kept) into text and calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# The compact JSON the schemas' grammars produce (model/grammar.py writes the same for response_format).
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the calls
    calls: tuple[Call, ...]


def _literal(text: str, special: frozenset[str]) -> str:
    """A Lark terminal for `text`: a special token by name, else the quoted text."""
    return text if text in special else json.dumps(text)


def call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """One call of any of `tools` as a JSON object {"name": <its name>, args_key: <its parameters>}."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                "properties": {"name": {"const": t["name"]}, args_key: t.get("parameters") or {"type": "object"}}}
               for t in tools]
    return {"anyOf": options, "x-guidance": _X_GUIDANCE} if len(options) > 1 else {**options[0],
                                                                                      "x-guidance": _X_GUIDANCE}


def _args_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {**(tool.get("parameters") or {"type": "object"}), "x-guidance": _X_GUIDANCE}


# Written bare in a grammar where the vocabulary has them as special tokens.
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|constrain|>", "<|message|>")


class ToolSyntax:
    name = ""
    trigger = ""  # what the model writes to start a call

    def __init__(self, special: frozenset[str]) -> None:
        self.special = special

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """Lark: one call of `tools` (or several when `parallel`), from its trigger on. (Under
        `auto` the grammar starts once the model has written the trigger: it is fed the trigger
        first, model/grammar.py.)"""
        raise NotImplementedError

    def forced(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """Lark: the answer of `required` or a named function, a call from the first token."""
        return self.grammar(tools, parallel)

    def parse(self, raw: str) -> Parsed:
        raise NotImplementedError


class Hermes(ToolSyntax):
    name = "hermes"
    trigger = "<tool_call>"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        open_, close = _literal("<tool_call>", self.special), _literal("</tool_call>", self.special)
        call = f'{open_} "\\n" %json {json.dumps(call_schema(tools))} "\\n" {close}'
        return f'start: {call} ("\\n" {call})*\n' if parallel else f"start: {call}\n"

    def parse(self, raw: str) -> Parsed:
        calls, spans = [], []
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", raw, re.S):
            call = _named_call(m.group(1), "arguments")
            if call is not None:
                calls.append(call)
                spans.append(m.span())
        if not calls:
            return Parsed(raw, ())
        return Parsed(raw[: spans[0][0]].strip(), tuple(calls))


class Llama3(ToolSyntax):
    name = "llama3-json"
    trigger = '{"name"'

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        return f"start: %json {json.dumps(call_schema(tools, 'parameters'))}\n"  # one call per answer

    def parse(self, raw: str) -> Parsed:
        text = raw.strip().removeprefix("<|python_tag|>").strip()
        call = _named_call(text, "parameters")
        return Parsed("", (call,)) if call is not None else Parsed(raw, ())


class MistralList(ToolSyntax):
    name = "mistral"
    trigger = "[TOOL_CALLS]"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = f"%json {json.dumps(call_schema(tools))}"
        items = f'"[" {call} (", " {call})* "]"' if parallel else f'"[" {call} "]"'
        return f"start: {_literal(self.trigger, self.special)} {items}\n"

    def parse(self, raw: str) -> Parsed:
        head, found, rest = raw.partition("[TOOL_CALLS]")
        if not found:
            return Parsed(raw, ())
        try:
            items = json.loads(rest.strip())
        except (ValueError, RecursionError):  # what a model wrote: too deep is not a call either
            return Parsed(raw, ())
        calls = [c for c in (_named_call(json.dumps(i), "arguments") for i in items if isinstance(i, dict))
                 if c is not None] if isinstance(items, list) else []
        return Parsed(head.strip(), tuple(calls)) if calls else Parsed(raw, ())


class MistralArgs(ToolSyntax):
    name = "mistral-args"
    trigger = "[TOOL_CALLS]"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        trig, args = _literal(self.trigger, self.special), _literal("[ARGS]", self.special)
        one = " | ".join(f"({json.dumps(t['name'])} {args} %json {json.dumps(_args_schema(t))})" for t in tools)
        return f"start: ({trig} ({one}))+\n" if parallel else f"start: {trig} ({one})\n"

    def parse(self, raw: str) -> Parsed:
        parts = raw.split("[TOOL_CALLS]")
        calls = []
        for part in parts[1:]:
            name, found, args = part.partition("[ARGS]")
            if found and _is_object(args.strip()):
                calls.append(Call(name.strip(), json.dumps(json.loads(args.strip()))))
        return Parsed(parts[0].strip(), tuple(calls)) if calls else Parsed(raw, ())


class Harmony(ToolSyntax):
    name = "harmony"
    trigger = "to=functions."
    _CALL = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)(.*?)<\|message\|>(.*?)(?=<\|call\|>|<\|end\|>|$)", re.S)
    _FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?=<\|return\|>|<\|end\|>|$)", re.S)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        constrain, message = _literal("<|constrain|>", self.special), _literal("<|message|>", self.special)
        one = " | ".join(f'({json.dumps(t["name"])} " " {constrain} "json" {message} '
                         f"%json {json.dumps(_args_schema(t))})" for t in tools)
        return f'start: "to=functions." ({one})\n'  # `parallel` or not: <|call|> ends the turn

    def forced(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        channel = _literal("<|channel|>", self.special)
        return self.grammar(tools, parallel).replace("start: ", f'start: {channel} "commentary " ', 1)

    def parse(self, raw: str) -> Parsed:
        calls = []
        for m in self._CALL.finditer(raw):
            if _is_object(m.group(3).strip()):
                calls.append(Call(m.group(1), json.dumps(json.loads(m.group(3).strip()))))
        if not calls:
            return Parsed(raw, ())
        final = self._FINAL.search(raw)
        return Parsed(final.group(1).strip() if final else "", tuple(calls))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _named_call(text: str, args_key: str) -> Call | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    return Call(obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def detect(template: str, special: frozenset[str]) -> ToolSyntax | None:
    """The syntax `template` renders tool calls in; None when it renders none (a 400 for `tools`)."""
    if "<tool_call>" in template:
        return Hermes(special)
    if "[TOOL_CALLS]" in template:
        return MistralArgs(special) if "[ARGS]" in template else MistralList(special)
    if "<|call|>" in template and "functions." in template:
        return Harmony(special)
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return Llama3(special)
    return None
