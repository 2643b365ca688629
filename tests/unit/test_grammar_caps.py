"""What a schema or grammar may ask of the grammar engine, checked before it compiles (issue 54):
the caps on properties, alternatives and repetitions, and whether any output can complete it."""

from __future__ import annotations

from typing import Any

import pytest

from shardline.model.gbnf_caps import check_grammar
from shardline.model.regex_size import regex_size
from shardline.model.schema_caps import (
    MAX_ALTERNATIVES,
    MAX_OBJECT_PROPERTIES,
    MAX_PROPERTIES,
    MAX_REPEAT,
    Budget,
    CapError,
    check_schema,
)
from shardline.model.schema_reach import unsatisfiable


def _object(n: int, prefix: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


@pytest.mark.parametrize("pattern,size", [
    ("^a{1000000}$", 10**6), ("^((a{100}){100}){100}$", 10**6), ("abc", 3), ("(a|bc)d", 4), ("[]a]{3}", 3),
    (r"\d{3}-\d{4}", 8), ("a{2,}", 2), (r"\p{L}{5}", 5), ("^[a-z]{1,64}@[a-z]{1,64}\\.[a-z]{2,8}$", 138),
    ("(a", 1), ("a)", 2), ("a{0}", 0),
])
def test_a_patterns_expanded_size(pattern: str, size: int) -> None:
    assert regex_size(pattern) == size


def test_chained_counts_stay_small_numbers() -> None:
    assert regex_size("a" + "{999999999}" * 10_000) <= 10**12


@pytest.mark.parametrize("schema,says", [
    (_object(MAX_OBJECT_PROPERTIES + 1), f"over the limit of {MAX_OBJECT_PROPERTIES} in one object"),
    ({"type": "object", "properties": {f"o{j}": _object(300, f"{j}p") for j in range(4)}},
     f"more than {MAX_PROPERTIES} properties in all"),
    ({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}} for i in range(3000)]},
     f"more than {MAX_ALTERNATIVES} alternatives"),
    ({"type": "object", "properties": {"a": {"enum": list(range(600))},
                                       "b": {"oneOf": [{"const": i} for i in range(600)]}}},
     f"more than {MAX_ALTERNATIVES} alternatives"),
    ({"type": "string", "pattern": "^a{1000000}$"}, "1,000,000 characters"),
    ({"type": "string", "pattern": "^((a{100}){100}){100}$"}, f"over the limit of {MAX_REPEAT:,}"),
    ({"type": "object", "patternProperties": {"^x{20000}$": {}}}, "20,000 characters"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^{i}a{{6000}}$"} for i in range(2)}},
     f"more than {MAX_REPEAT:,} characters in all"),
])
def test_schemas_over_a_cap_are_refused(schema: dict[str, Any], says: str) -> None:
    with pytest.raises(CapError, match=says):
        check_schema(schema)


def test_schemas_at_the_caps_pass() -> None:
    check_schema({"type": "object", "properties": {"a": _object(MAX_OBJECT_PROPERTIES),
                                                   "b": {"enum": list(range(MAX_ALTERNATIVES))},
                                                   "c": {"type": "string", "pattern": f"^a{{{MAX_REPEAT}}}$"}}})


def test_the_same_pattern_again_counts_once() -> None:
    check_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^a{6000}$"}
                                                   for i in range(100)}})


def test_a_property_named_like_a_keyword_is_a_property() -> None:
    check_schema({"type": "object", "properties": {"enum": {"type": "string"}, "pattern": {"type": "string"},
                                                   "anyOf": {"type": "integer"}}, "default": {"enum": [1] * 5000}})


def test_tools_share_one_budget() -> None:
    budget = Budget()
    check_schema(_object(400), budget)
    check_schema(_object(400), budget)
    with pytest.raises(CapError, match="properties in all"):
        check_schema(_object(400), budget)


REQUIRED_SELF: Any = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


@pytest.mark.parametrize("schema", [
    REQUIRED_SELF,
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["v", "next"],
                                          "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}}}}},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
    {"anyOf": [{"$ref": "#"}]},
    {"allOf": [{"type": "string"}, {"enum": []}]},
    {"type": "object", "required": ["a"], "additionalProperties": False},
])
def test_a_schema_no_finite_value_satisfies_is_found(schema: dict[str, Any]) -> None:
    assert unsatisfiable(schema) is not None
    with pytest.raises(CapError, match="no finite value satisfies it"):
        check_schema(schema)


@pytest.mark.parametrize("schema", [
    {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # no type: a string satisfies it
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional: {} ends it
    {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["v", "kids"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}},
    {"$ref": "#/nowhere"},  # the engine's own error, not this check's
    {"type": "object", "properties": {"a~/b": {"type": "string"}}, "required": ["x"],
     "additionalProperties": {"$ref": "#/properties/a~0~1b"}},
])
def test_a_schema_some_value_satisfies_passes(schema: dict[str, Any]) -> None:
    assert unsatisfiable(schema) is None


@pytest.mark.parametrize("grammar,says", [
    ("root ::= " + " | ".join(f'"w{i}"' for i in range(20_000)), "20000 alternatives"),
    ('root ::= "a"{1000000}', "1,000,000 terminals"),
    ('root ::= x{1000}\nx ::= "a"{1000}', "1,000,000 terminals"),
    ('root ::= x\nx ::= x "a"', "can never end"),
    ('root ::= "a" x\nx ::= ("b" | "c") x', "can never end"),
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "nested too deeply"),
    ('start: "a"~1000000', "over the limit"),
    ("start: " + " | ".join(f'"w{i}"' for i in range(2000)), "alternatives"),
])
def test_grammars_over_a_cap_or_without_an_end_are_refused(grammar: str, says: str) -> None:
    with pytest.raises(CapError, match=says):
        check_grammar(grammar)


@pytest.mark.parametrize("grammar", [
    'root ::= answer "." \nanswer ::= "yes" | "no"',
    'root ::= object\nvalue ::= object | array | string\n'
    'object ::= "{" ( string ":" value ("," string ":" value)* )? "}"\n'
    'array ::= "[" (value ("," value)*)? "]"\nstring ::= "\\"" [a-z]* "\\""',
    'root ::= "a"{10000}',
    'root ::= x+\nx ::= "a" | x "b"',
    'start: "a" | "b"',
    "root ::= missing",  # the engine names the missing rule
])
def test_ordinary_grammars_pass(grammar: str) -> None:
    check_grammar(grammar)
