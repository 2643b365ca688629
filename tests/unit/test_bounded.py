"""JSON from a client parsed with bounded depth (issue 54): too deep is a 400 naming the field the
nesting is under, or "body" for the envelope, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from shardline.api.bounded import MAX_DEPTH, body, deeper, loads, too_deep
from shardline.api.schemas import ApiError


def _nested(levels: int, leaf: object = 1) -> object:
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_depth_is_counted_from_the_value_itself() -> None:
    assert too_deep([[[]]], 3) is None
    assert too_deep([[[]]], 2) == (0, 0)
    assert too_deep({"a": [1, {"b": {}}]}, 2) == ("a", 1)
    assert too_deep(_nested(MAX_DEPTH)) is None and too_deep(_nested(MAX_DEPTH + 1)) is not None
    assert too_deep("a string, however long", 0) is None
    for value in ([[[]]], {"a": [1, {"b": {}}]}, _nested(MAX_DEPTH), _nested(MAX_DEPTH + 1), "x", {}):
        for limit in (0, 1, 2, 3, MAX_DEPTH):
            assert deeper(value, limit) == (too_deep(value, limit) is not None)


@pytest.mark.parametrize("text", [json.dumps(_nested(MAX_DEPTH + 1)), "[" * 2000 + "]" * 2000,
                                  '{"a": ' * 100_000 + "1" + "}" * 100_000])
def test_too_deep_text_is_a_400_naming_its_field(text: str) -> None:
    with pytest.raises(ApiError) as e:
        loads(text, "messages[1].tool_calls[0].function.arguments")
    assert (e.value.status, e.value.param) == (400, "messages[1].tool_calls[0].function.arguments")
    assert f"nested deeper than {MAX_DEPTH} levels" in e.value.message


def test_text_that_is_not_json_is_a_400_naming_its_field() -> None:
    for text in ("{not json", "1" * 5000):
        with pytest.raises(ApiError, match="not valid JSON") as e:
            loads(text, "x")
        assert e.value.param == "x"
    assert loads('{"a": [1, 2]}', "x") == {"a": [1, 2]}


@pytest.mark.parametrize("raw,param", [
    (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "messages"),  # past Python's parser
    (json.dumps({"model": "m", "tools": [_nested(MAX_DEPTH)]}).encode(), "tools"),  # past the limit only
    (json.dumps({"model": "m", "response_format": _nested(MAX_DEPTH)}).encode(), "response_format"),
    (b"[" * 5000 + b"]" * 5000, "body"),
    (json.dumps([_nested(MAX_DEPTH)]).encode(), "body"),
    (b'{"model": "m", "a": 1, "b": {"c": ' + b"[" * 3000 + b"]" * 3000 + b"}}", "b"),
])
def test_a_too_deep_body_names_the_top_level_field(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as e:
        body(raw)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_a_body_within_the_limit_parses() -> None:
    value = {"model": "m", "response_format": _nested(MAX_DEPTH - 2)}
    assert body(json.dumps(value).encode()) == value
    with pytest.raises(ValueError):
        body(b"{not json")
