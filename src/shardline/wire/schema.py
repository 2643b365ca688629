"""What every field of every message is on the wire, worked out once per class from its type hints.

Scalar fields travel as JSON and each has a form: int (64-bit, never a bool, never a float),
float (finite; an int is accepted), str (valid Unicode), bool, a StrEnum (one of its values), a
list of a form, or a dataclass such as SamplingParams (a JSON object with exactly its fields,
each checked, then constructed so that its own range checks run). `load` turns a decoded JSON
value into the field's value; `dump` turns a field's value into JSON-ready data. Both raise
ValueError saying what is wrong: on decode the peer's frame is refused, on encode our own bug
fails before anything is sent.

Array fields follow the message's ARRAYS entry: allowed dtypes (as wire dtype codes), exact
number of dimensions, and whether the field may be None.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, get_args, get_origin, get_type_hints

import numpy as np

from shardline.errors import ShardlineError
from shardline.wire.messages import MESSAGES, Arr

# Wire dtype codes; arrays travel little-endian whatever the host.
DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("<i8"), 4: np.dtype("<i4"), 5: np.dtype("u1"),
    6: np.dtype("<f8"),
}
CODES: dict[np.dtype[Any], int] = {v: k for k, v in DTYPES.items()}
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1  # every wire int fits an i64, as the stages use them


def show(v: object, limit: int = 40) -> str:
    """A value for an error message: a peer may send megabytes of it, the message stays one line."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class Form(Protocol):
    def load(self, v: object) -> object: ...
    def dump(self, v: object) -> object: ...


class _Int:
    def load(self, v: object) -> int:
        if type(v) is not int:  # JSON true/false are bools, 1.0 is a float: neither is an int here
            raise ValueError(f"{show(v)} is not an integer")
        if not I64_MIN <= v <= I64_MAX:
            raise ValueError(f"{show(v)} is outside the 64-bit range")
        return v

    dump = load


class _Float:
    def load(self, v: object) -> object:
        if type(v) is int:
            return float(_INT.load(v))  # checked first: float() of a huge int overflows
        if type(v) is not float:
            raise ValueError(f"{show(v)} is not a number")
        if not math.isfinite(v):
            raise ValueError(f"{v} is not finite")
        return v

    dump = load


class _Str:
    def load(self, v: object) -> object:
        if not isinstance(v, str):
            raise ValueError(f"{show(v)} is not a string")
        try:  # JSON may carry a lone surrogate ("\ud800"): text no file name or log line can hold
            v.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{show(v)} is not valid Unicode") from None
        return str(v)

    dump = load


class _Bool:
    def load(self, v: object) -> object:
        if type(v) is not bool:
            raise ValueError(f"{show(v)} is not true or false")
        return v

    dump = load


class _Enum:
    def __init__(self, cls: type[StrEnum]) -> None:
        self.cls = cls
        self.members: dict[str, StrEnum] = {m.value: m for m in cls}  # plain str keys: members hash by name

    def load(self, v: object) -> StrEnum:
        member = self.members.get(v) if type(v) is str else None
        if member is None:
            raise ValueError(f"{show(v)} is not one of {', '.join(self.members)}")
        return member

    def dump(self, v: object) -> object:
        # A member, or a plain str of one of its values (the dataclasses do not convert).
        return (v if isinstance(v, self.cls) else self.load(v)).value


class _List:
    def __init__(self, item: Form) -> None:
        self.item = item

    def load(self, v: object) -> object:
        if type(v) is not list:
            raise ValueError(f"{show(v)} is not a list")
        return _each(self.item.load, v)

    def dump(self, v: object) -> object:
        if not isinstance(v, list | tuple):
            raise ValueError(f"{show(v)} is not a list")
        return _each(self.item.dump, v)


class _Object:
    """A dataclass as a JSON object with exactly its fields."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        hints = get_type_hints(cls)
        self.fields = tuple((f.name, form(hints[f.name], f"{cls.__name__}.{f.name}")) for f in dataclasses.fields(cls))
        self.names = frozenset(name for name, _ in self.fields)

    def load(self, v: object) -> object:
        if type(v) is not dict:
            raise ValueError(f"{show(v)} is not a {self.cls.__name__} object")
        if v.keys() != self.names:
            raise ValueError(f"{self.cls.__name__} fields {show(sorted(v))}, expected {sorted(self.names)}")
        values = _load_each(self.fields, v, ".")
        try:
            return self.cls(**values)
        except (ShardlineError, ValueError, TypeError) as e:  # its own range checks
            raise ValueError(f"{self.cls.__name__}: {e}") from None

    def dump(self, v: object) -> object:
        if not isinstance(v, self.cls):
            raise ValueError(f"{show(v)} is not a {self.cls.__name__}")
        return _dump_each(self.fields, v, ".")


_INT, _FLOAT, _STR, _BOOL = _Int(), _Float(), _Str(), _Bool()


def form(hint: object, where: str) -> Form:
    """The form of a JSON field declared as `hint`; TypeError (at import) for one with no form."""
    if hint is bool:
        return _BOOL
    if hint is int:
        return _INT
    if hint is float:
        return _FLOAT
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return _Enum(hint)
    if hint is str:
        return _STR
    if get_origin(hint) is list:
        return _List(form(get_args(hint)[0], f"{where}[]"))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _Object(hint)
    raise TypeError(f"{where}: no wire form for {hint!r}")


@dataclass(frozen=True)
class ArrayForm:
    name: str
    codes: frozenset[int]  # allowed wire dtype codes
    dtypes: str  # the same, for messages
    ndim: int
    optional: bool


@dataclass(frozen=True)
class Schema:
    kind: int
    cls: type
    meta: tuple[tuple[str, Form], ...]  # JSON fields, in field order
    meta_names: frozenset[str]
    arrays: tuple[ArrayForm, ...]  # binary fields, in field order (the order they travel in)


def _array_hint(hint: object) -> bool | None:
    """None: not an array field; else whether it may be None."""
    if hint is np.ndarray:
        return False
    if isinstance(hint, types.UnionType) and np.ndarray in get_args(hint):
        if set(get_args(hint)) != {np.ndarray, type(None)}:
            raise TypeError(f"no wire form for {hint!r}")
        return True
    return None


def _array_form(cls: type, name: str, optional: bool) -> ArrayForm:
    spec: Arr | None = cls.ARRAYS.get(name)  # type: ignore[attr-defined]
    if spec is None or spec.optional != optional:
        raise TypeError(f"{cls.__name__}.{name}: ARRAYS says {spec}, the field may{'' if optional else ' not'} "
                        f"be None")
    codes = frozenset(CODES[np.dtype(d).newbyteorder("<")] for d in spec.dtypes)
    return ArrayForm(name, codes, "/".join(spec.dtypes), spec.ndim, spec.optional)


def schema(kind: int, cls: type) -> Schema:
    hints = get_type_hints(cls)
    meta: list[tuple[str, Form]] = []
    arrays: list[ArrayForm] = []
    for f in dataclasses.fields(cls):
        optional = _array_hint(hints[f.name])
        if optional is None:
            meta.append((f.name, form(hints[f.name], f"{cls.__name__}.{f.name}")))
        else:
            arrays.append(_array_form(cls, f.name, optional))
    if extra := set(cls.ARRAYS) - {a.name for a in arrays}:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}.ARRAYS names {sorted(extra)}, which are not array fields")
    return Schema(kind, cls, tuple(meta), frozenset(name for name, _ in meta), tuple(arrays))


# Worked out once, at import: a message class whose fields have no wire form fails loudly here.
SCHEMAS: dict[int, Schema] = {kind: schema(kind, cls) for kind, cls in MESSAGES.items()}
BY_CLASS: dict[type, Schema] = {s.cls: s for s in SCHEMAS.values()}


def load_meta(s: Schema, meta: dict[str, object]) -> dict[str, object]:
    """The typed values of a message's JSON fields, or ValueError."""
    if meta.keys() != s.meta_names:
        raise ValueError(f"fields {show(sorted(meta), 200)} != {sorted(s.meta_names)}")
    return _load_each(s.meta, meta, "")


# The three loops below convert each part of a value, prefixing an error with where it happened.
# Plain loops, not a helper call per part: they run for every field of every frame.


def _load_each(fields: tuple[tuple[str, Form], ...], data: dict[str, Any], prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, f in fields:
        try:
            out[name] = f.load(data[name])
        except ValueError as e:
            raise ValueError(f"{prefix}{name}: {e}") from None
    return out


def _dump_each(fields: tuple[tuple[str, Form], ...], obj: object, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, f in fields:
        try:
            out[name] = f.dump(getattr(obj, name))
        except ValueError as e:
            raise ValueError(f"{prefix}{name}: {e}") from None
    return out


def _each(convert: Callable[[object], object], items: Iterable[object]) -> list[object]:
    out: list[object] = []
    for i, x in enumerate(items):
        try:
            out.append(convert(x))
        except ValueError as e:
            raise ValueError(f"[{i}]: {e}") from None
    return out


def dump_meta(s: Schema, msg: object) -> dict[str, object]:
    """JSON-ready data of a message's JSON fields, or ValueError for a value of the wrong type."""
    return _dump_each(s.meta, msg, "")
