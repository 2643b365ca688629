"""JSON a client sends, parsed with bounded depth (issue 54): the request body, and the JSON
inside its strings (a tool call's `arguments`). Deep nesting is no data anyone means to send,
and everything after the parse recurses on it (pydantic, chat templates, json.dumps, the
grammar engine's compiler): 2,000 levels of tool-call arguments were a RecursionError and a 500.

Python's own parser raises RecursionError past about 1,000 levels (it checks its stack, so the
error is clean): that is caught, and the top-level field it happened under found by parsing the
body's values one by one. What parses is walked level by level, without recursion, for the
limit; only a value over it is walked again for the path that names the field. Over the limit, a
400 naming the field the nesting is under ("body" for the envelope itself)."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from shardline.api.schemas import ApiError

M = TypeVar("M", bound=BaseModel)

MAX_DEPTH = 64  # objects and arrays inside each other, the body's own object included
_SPACE = re.compile(r"[ \t\n\r]*")
def deeper(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether objects and arrays nest deeper than `limit` in `value` (itself at depth 1): level
    by level, nothing allocated per value but the next level's list (~2 ms for 8,000 properties,
    where a walk that kept each value's path took 18-30 ms)."""
    level, depth = [value] if type(value) is dict or type(value) is list else [], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for node in level:
            for v in node.values() if type(node) is dict else node:
                if type(v) is dict or type(v) is list:  # what json.loads makes: no subclasses
                    below.append(v)
        level = below
    return False


def too_deep(value: Any, limit: int = MAX_DEPTH) -> tuple[Any, ...] | None:
    """The path (keys and indexes) to the first object or array of `value` nested deeper than
    `limit` (`value` itself is at depth 1), or None; no recursion."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if len(path) >= limit:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, (*path, k)) for k, v in items if isinstance(v, dict | list))
    return None


def loads(text: str | bytes, param: str, limit: int = MAX_DEPTH) -> Any:
    """`text` parsed, at most `limit` deep; ApiError 400 naming `param` when it is not JSON or
    nested deeper."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _deep(param, limit) from None
    except ValueError as e:  # JSONDecodeError, or what Python refuses (an integer of 5,000 digits)
        raise ApiError(400, f"{param}: not valid JSON: {str(e)[:200]}", param=param) from None
    if deeper(value, limit):
        raise _deep(param, limit)
    return value


def body(raw: bytes, limit: int = MAX_DEPTH) -> Any:
    """A request body parsed, at most `limit` deep; too deep is a 400 naming the top-level field
    the nesting is under (or "body"). Not JSON: ValueError (the caller's message)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _deep(_deep_field(raw) or "body", limit) from None
    if not deeper(value, limit):
        return value
    path = too_deep(value, limit)  # which field: walked again, with paths, only now
    raise _deep(str(path[0]) if isinstance(value, dict) and path else "body", limit)


async def parsed(request: Request, model: type[M]) -> M:
    """The request's body as `model`: parsed here, not by FastAPI, so that its depth is bounded
    before pydantic walks it. JSON only (as FastAPI's strict content type); errors are 400s."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not (kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))):
        raise ApiError(400, "body: must be JSON, sent as Content-Type: application/json", param="body")
    try:
        value = body(await request.body())
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    try:
        return model.model_validate(value)
    except ValidationError as e:  # named as FastAPI names a body's errors (api/app.py answers them)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]) \
            from None


def _deep(param: str, limit: int) -> ApiError:
    return ApiError(400, f"{param}: nested deeper than {limit} levels of objects and arrays", param=param)


def _deep_field(raw: bytes) -> str | None:
    """The top-level key of a body object whose value Python's parser cannot parse for depth
    (each value parsed alone, at C speed); None when the envelope itself is too deep."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    decoder, at = json.JSONDecoder(), _skip(text, 0)
    if text[at:at + 1] != "{":
        return None
    at += 1
    while True:
        try:
            key, at = decoder.raw_decode(text, _skip(text, at))
        except (ValueError, RecursionError):
            return None
        at = _skip(text, at)
        if not isinstance(key, str) or text[at:at + 1] != ":":
            return None
        try:
            _, at = decoder.raw_decode(text, _skip(text, at + 1))
        except RecursionError:
            return key
        except ValueError:
            return None
        at = _skip(text, at)
        if text[at:at + 1] != ",":
            return None
        at += 1


def _skip(text: str, at: int) -> int:
    m = _SPACE.match(text, at)
    return m.end() if m else at
