"""OpenAI tools on chat completions (issue 40): the request's tools and tool_choice checked, the
conversation (assistant tool calls, tool results) put in the form chat templates read, the
constraint that holds a call to its function's parameters, and the model's calls read back.

Which syntax the model writes calls in comes from its chat template (model/tool_calls.py): a
template that renders no tools makes `tools` a 400, not a guess. With `required` or a named
function the answer is constrained from its first token; with `auto` only once the model starts a
call (a lazy grammar: model/grammar.LazyConstraint), so it may answer in text instead.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from shardline.api.bounded import loads
from shardline.api.schemas import ApiError, ChatRequest
from shardline.model.grammar import GrammarConstraint, GrammarError, Grammars, GrammarSpec, LazyConstraint
from shardline.model.schema_caps import Budget, CapError, check_schema
from shardline.model.tokenizer import ChatTokenizer
from shardline.model.tool_calls import MARKERS, Call, Parsed, ToolSyntax

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolPlan:
    syntax: ToolSyntax
    tools: list[dict[str, Any]]  # each function: name, description, parameters
    choice: str  # "auto", "required" or a function's name
    parallel: bool

    def constraint(self, grammars: Grammars) -> GrammarConstraint | LazyConstraint:
        """Raises GrammarError (a 400 naming `tools`) for parameters the engine cannot compile, or
        that are over the caps together (they make one grammar) or that no value satisfies."""
        offered = self.tools if self.choice in ("auto", "required") else [t for t in self.tools
                                                                          if t["name"] == self.choice]
        budget = Budget()
        for t in offered:
            try:
                check_schema(t["parameters"], budget)
            except CapError as e:
                raise GrammarError(f"{t['name']}'s parameters: {e}") from None
        syntax = type(self.syntax)(grammars.special(MARKERS))  # the engine's own view of the markers
        if self.choice == "auto":
            return grammars.lazy(GrammarSpec("lark", syntax.grammar(offered, self.parallel)), syntax.trigger)
        return grammars.constraint(GrammarSpec("lark", syntax.forced(offered, self.parallel)))


def tool_plan(body: ChatRequest, tok: ChatTokenizer) -> ToolPlan | None:
    """The request's tools and choice, checked (ApiError naming the field); None when the answer
    is plain text (no tools, or tool_choice "none")."""
    tools = _functions(body.tools or [])
    choice = _choice(body.tool_choice, tools)
    if not tools or choice == "none":
        return None
    syntax = tok.tool_syntax
    if syntax is None:
        raise ApiError(400, "tools: this model's chat template renders no tools (a ChatML model can be served "
                            "with `--chat-template chatml-tools`)", param="tools", code="unsupported_parameter")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise _bad("response_format", 'cannot be combined with tools (give tool_choice "none" for a formatted answer)')
    return ToolPlan(syntax, tools, choice, body.parallel_tool_calls is not False)


def _functions(tools: list[Any]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(where, 'each tool must be {"type": "function", "function": {...}}')
        f = t["function"]
        name, params = f.get("name"), f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if any(o["name"] == name for o in out):
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        if not isinstance(f.get("description", ""), str):
            raise _bad(f"{where}.function.description", "must be a string")
        out.append({"name": name, "description": f.get("description", ""), "parameters": params})
    return out


def _choice(choice: Any, tools: list[dict[str, Any]]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _bad("tool_choice", '"required" needs tools')
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t["name"] == name for t in tools):
            raise _bad("tool_choice.function.name", f"{str(name)[:64]!r} is not one of the tools")
        return str(name)
    raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')


def offered(plan_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as templates read them (OpenAI's form)."""
    return [{"type": "function", "function": t} for t in plan_tools]


def template_messages(body: ChatRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: an assistant's calls with their arguments as
    objects, a tool's result with its function's name. A result must answer a call made before
    it (ApiError naming the message)."""
    calls: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "only an assistant message makes tool calls")
            msg["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]", calls) for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            call_id = (m.model_extra or {}).get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise _bad(f"messages[{i}].tool_call_id", "must name a tool call of an earlier assistant message")
            msg["tool_call_id"], msg["name"] = call_id, calls[call_id]
        out.append(msg)
    return out


def _call(c: Any, where: str, calls: dict[str, str]) -> dict[str, Any]:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise _bad(where, 'must be {"id": ..., "type": "function", "function": {"name", "arguments"}}')
    call_id, f = c.get("id"), c["function"]
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= 256:
        raise _bad(f"{where}.id", "must be a string of 1-256 characters")
    if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
        raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
    text = f.get("arguments", "{}")
    args = loads(text or "{}", f"{where}.function.arguments") if isinstance(text, str) else None  # depth-bounded
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments", "must be a JSON object, as text")
    calls[call_id] = f["name"]
    return {"id": call_id, "type": "function", "function": {"name": f["name"], "arguments": args}}


def openai_calls(calls: tuple[Call, ...]) -> list[dict[str, Any]]:
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class ToolStream:
    """What a streamed answer shows while the model may be writing a call: text up to the call's
    trigger (a tail that could be the trigger's start held back), then nothing until the end, when
    the calls are read from the raw output (special tokens kept)."""

    def __init__(self, plan: ToolPlan, tok: ChatTokenizer) -> None:
        self.plan, self.tok = plan, tok
        self._text = ""  # every visible character so far
        self.shown = 0  # of which streamed as content
        self.calling = False
        trig = plan.syntax.trigger
        ids = tok.tokens(trig)
        self._trigger_id = ids[0] if len(ids) == 1 and trig in tok.control_tokens else None

    def push(self, text: str, tokens: list[int]) -> str:
        """The content `text` (and the tokens it came with) lets through now."""
        self._text += text
        trig = self.plan.syntax.trigger
        if not self.calling and (trig in self._text or (self._trigger_id is not None and self._trigger_id in tokens)):
            self.calling = True
        if self.calling:
            return ""
        hold = next((k for k in range(min(len(trig) - 1, len(self._text)), 0, -1) if self._text.endswith(trig[:k])), 0)
        out = self._text[self.shown : len(self._text) - hold]
        self.shown += len(out)
        return out

    def end(self, tokens: list[int]) -> tuple[str, Parsed]:
        """At the end: content not yet shown, and what the model wrote read as text and calls."""
        parsed = self.plan.syntax.parse(self.tok.raw.decode(tokens, skip_special_tokens=False))
        if not parsed.calls:
            rest = self._text[self.shown :]
        else:
            rest = parsed.content[self.shown :] if parsed.content.startswith(self._text[: self.shown]) else ""
        self.shown += len(rest)
        return rest, parsed
