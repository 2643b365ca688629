"""What every runner kind keeps per key: one record (a stream's, or a decode group's whose
streams are its rows) with the slots and rows its KV holds.

A key is opened fresh, stepped, moved to another name (a decode group's merge, a stream leaving
one) and closed; an unknown key, or opening one twice, is a `StepRefused` for that step, never a
crash. The record itself is the runner's: a stateful runner's holds an infer request (its KV in
the graph), a static runner's a host ring.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from shardline.errors import StepRefused

Key = Hashable


class Held(Protocol):
    slots: int  # physical KV entries of every row
    rows: int  # rows of the state (0: fresh, no step run yet)


H = TypeVar("H", bound=Held)


def shown(key: Key) -> object:
    """A key as its coordinator knows it (a worker scopes keys as (session, key))."""
    return key[-1] if isinstance(key, tuple) else key


class Keyed(Generic[H]):
    """The keys a runner holds, each with its record `H`; `fresh()` makes a new key's record."""

    name: str  # the stage's, for errors

    def __init__(self) -> None:
        self._keys: dict[Key, H] = {}

    def fresh(self) -> H:
        raise NotImplementedError

    def open(self, key: Key) -> None:
        if key in self._keys:
            raise StepRefused(f"key {shown(key)} is already open on {self.name}")
        self._keys[key] = self.fresh()

    def has(self, key: Key) -> bool:
        return key in self._keys

    def keys(self) -> list[Key]:
        return list(self._keys)

    def close(self, key: Key) -> None:
        """Drop the key's record and with it its KV (an unknown key is a no-op)."""
        self._keys.pop(key, None)

    def move(self, key: Key, to: Key) -> None:
        """The record of `key` (and its KV) is known as `to` from now on."""
        if to in self._keys:
            raise StepRefused(f"key {shown(to)} is already open on {self.name}")
        self._keys[to] = self.held(key)
        del self._keys[key]

    def slots(self, key: Key) -> int:
        return self.held(key).slots

    def rows(self, key: Key) -> int:
        return self.held(key).rows

    def held(self, key: Key) -> H:
        record = self._keys.get(key)
        if record is None:
            raise StepRefused(f"unknown key {shown(key)} on {self.name}")
        return record
