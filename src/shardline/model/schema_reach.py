"""Pure: whether any finite JSON value satisfies a schema through its local references (issue 54).

A schema whose every value must contain another value of itself (`{"type": "object",
"properties": {"x": {"$ref": "#"}}, "required": ["x"]}`, `$defs` referring to each other in a
loop) compiles, and a constrained stream then writes forever, or until the grammar engine gives
up mid-answer. This finds it before a request is admitted: the least fixpoint of "some finite
value satisfies it" over the schema's `$ref` targets, as one decides which rules of a context-free
grammar can end.

From above: only what makes a value impossible is read (`false`, an empty `enum`, `allOf`,
`anyOf`/`oneOf` with no satisfiable member, an object or array type whose required properties or
first `minItems` items cannot be satisfied, a `$ref` to such a schema). Anything else counts as
satisfiable: the grammar engine refuses what it cannot compile itself."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MAX_PASSES = 16  # fixpoint passes (each walks every target once); a longer chain is left to the engine
_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: never walked
_MISSING = object()


def unsatisfiable(schema: Any) -> str | None:
    """Why no finite value satisfies `schema` (None: some value may)."""
    if not isinstance(schema, dict):
        return None
    targets = _targets(schema)
    known = dict.fromkeys(targets, False)  # least fixpoint: nothing is satisfiable until shown
    for _ in range(MAX_PASSES):
        grown = [ref for ref, node in targets.items() if not known[ref] and _can(node, known)]
        known.update(dict.fromkeys(grown, True))
        if not grown:
            break
    else:
        return None  # not settled: say nothing rather than refuse a schema that may be fine
    if _can(schema, known):
        return None
    loops = sorted(ref for ref, ok in known.items() if not ok)
    through = f" (through {', '.join(loops[:3])})" if loops else ""
    return f"no finite value satisfies it: every value would have to contain another one{through}"


def _targets(root: dict[str, Any]) -> dict[str, Any]:
    """Every local `$ref` of `root` that resolves, with what it names (walked without recursion)."""
    out: dict[str, Any] = {}
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in out and (target := _resolve(root, ref)) is not _MISSING:
                out[ref] = target
            stack.extend(v for k, v in node.items() if k not in _DATA)
    return out


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """A local JSON pointer (`#`, `#/$defs/a`) in `root`; _MISSING when it names nothing here."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING
    node: Any = root
    for part in ref[2:].split("/"):
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _MISSING
    return node


def _can(node: Any, known: dict[str, bool]) -> bool:
    """Some finite value satisfies `node`, given which references are known to be satisfiable."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    if "enum" in node or "const" in node:
        return not (isinstance(node.get("enum"), list) and not node["enum"])
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    if isinstance(node.get("allOf"), list) and not all(_can(s, known) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_can(s, known) for s in node[key]):
            return False
    return _typed(node, known)


def _typed(node: dict[str, Any], known: dict[str, bool]) -> bool:
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kinds is None or any(k not in ("object", "array") for k in kinds):
        return True  # a value of another type (a string, a number...) may do
    return ("object" in kinds and _object(node, known)) or ("array" in kinds and _array(node, known))


def _object(node: dict[str, Any], known: dict[str, bool]) -> bool:
    props, required = node.get("properties"), node.get("required")
    props = props if isinstance(props, dict) else {}
    required = required if isinstance(required, list) else []
    other = node.get("additionalProperties", True)
    return all(_can(props.get(name, other), known) for name in required if isinstance(name, str))


def _array(node: dict[str, Any], known: dict[str, bool]) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    items = node.get("items", True)
    prefix = node.get("prefixItems", items if isinstance(items, list) else [])
    rest = items if not isinstance(items, list) else node.get("additionalItems", True)
    if not isinstance(prefix, list):
        prefix = []
    if not all(_can(s, known) for s in prefix[:least]):
        return False
    return least <= len(prefix) or _can(rest, known)
