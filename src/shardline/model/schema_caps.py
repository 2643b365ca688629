"""Pure: what a request's JSON schemas may ask of the grammar engine, checked before compiling
(issue 54). llguidance's own limits (model/grammar_probe.py) bound its steps, but some of its
costs come before any limit is looked at: an object of 8,000 optional properties took 3 s to
validate and 11 s to build a matcher on this machine, and only then failed its grammar-size
limit. These caps keep every compile well inside the time limit (BENCHMARKS.md, issue 54):

- properties: 400 in one object (llguidance's parser rows hold about 4 items per optional
  property and refuse more than 2,000: 500 optional properties failed on the first `{`), 1,000 in
  all of a request's schemas (1,000 optional ones build in 0.2 s; cost grows as n^1.7);
- alternatives (`anyOf`/`oneOf` members and `enum` values): 1,000 in all, half the parser's
  row limit (3,000 objects in an `anyOf` failed on the first `{`); OpenAI allows 1,000 enum values;
- repetitions: the `pattern`s (and `patternProperties` names) spelling out at most 10,000
  characters once their counts are expanded, each distinct one counted once (model/regex_size.py:
  one of 10^4 compiles in 40 ms, 10^5 in 0.6 s, 10^6 fails after 1-2 s; and they add up: 60
  distinct ones of 10^4 took 0.5 s for the first mask and 0.13 s for every token after)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardline.model.regex_size import regex_size
from shardline.model.schema_reach import unsatisfiable

MAX_OBJECT_PROPERTIES = 400
MAX_PROPERTIES = 1000
MAX_ALTERNATIVES = 1000
MAX_REPEAT = 10_000
_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: never walked


class CapError(ValueError):
    """A schema or grammar over a cap, or one no output can complete (the message says which)."""


@dataclass
class Budget:
    """What the schemas compiled into one grammar have used of the caps (a request's tools share one)."""

    properties: int = 0
    alternatives: int = 0
    spelled: int = 0  # the distinct patterns' expanded sizes, added up
    patterns: set[str] = field(default_factory=set)


def check_schema(schema: Any, budget: Budget | None = None) -> None:
    """Raise CapError if `schema` is over a cap, or no finite value satisfies it."""
    budget = budget if budget is not None else Budget()
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:  # no recursion: depth is the body's business (api/bounded.py), not this walk's
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
        elif isinstance(node, dict):
            _caps(node, path, budget)
            stack.extend((v, f"{path}/{k}") for k, v in node.items() if k not in _DATA and isinstance(v, dict | list))
    if (why := unsatisfiable(schema)) is not None:
        raise CapError(why)


def _caps(node: dict[str, Any], path: str, budget: Budget) -> None:
    props = node.get("properties")
    if isinstance(props, dict):
        if len(props) > MAX_OBJECT_PROPERTIES:
            raise CapError(f"the object at {path} has {len(props)} properties, over the limit of "
                           f"{MAX_OBJECT_PROPERTIES} in one object")
        budget.properties += len(props)
        if budget.properties > MAX_PROPERTIES:
            raise CapError(f"more than {MAX_PROPERTIES} properties in all (at {path})")
    for key in ("anyOf", "oneOf", "enum"):
        if isinstance(node.get(key), list):
            budget.alternatives += len(node[key])
    if budget.alternatives > MAX_ALTERNATIVES:
        raise CapError(f"more than {MAX_ALTERNATIVES} alternatives (anyOf, oneOf and enum values) in all (at {path})")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for p in patterns:
        if p in budget.patterns:
            continue  # the same pattern again is the same lexeme to the engine
        budget.patterns.add(p)
        if (size := regex_size(p)) > MAX_REPEAT:
            raise CapError(f"a pattern at {path} spells out {min(size, 10**9):,} characters once its counts are "
                           f"expanded, over the limit of {MAX_REPEAT:,}")
        budget.spelled += size
        if budget.spelled > MAX_REPEAT:
            raise CapError(f"the patterns spell out more than {MAX_REPEAT:,} characters in all once their counts "
                           f"are expanded (at {path})")
