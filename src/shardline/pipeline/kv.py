"""A key's KV state as it leaves one pipeline and enters another over the same export (the first
step of issue 13's KV transfer, prefill instance -> decode instance).

`KvSnapshot` is what the stages hold: per stage its layer range and its state arrays by name.
`Handoff` adds what the coordinator holds: the stream's KVBook. `check` is everything an
importing pipeline can refuse before any stage is touched.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.manifest import Manifest
from shardline.stage.cache import KVBook


def export_identity(manifest: Manifest) -> str:
    """What must be equal for KV to mean the same on both sides: the model (its hash covers a
    truncation too) and its weights (gguf and fp32 weights give different keys and values)."""
    return f"{manifest.model_hash}/{manifest.weights}/{manifest.group_size}"


@dataclass(frozen=True)
class StageKv:
    first_layer: int
    last_layer: int
    arrays: Mapping[str, np.ndarray]  # state variable -> [rows, kv_heads, slots, head_dim], read-only


@dataclass(frozen=True)
class StageLayout:
    """What an importing stage accepts: its layers and, per state variable, (dtype, kv_heads, head_dim)."""

    first_layer: int
    last_layer: int
    states: Mapping[str, tuple[np.dtype, int, int]]

    @property
    def slot_bytes(self) -> int:
        """The bytes one slot (one token of one row) of its KV takes."""
        return sum(np.dtype(dtype).itemsize * heads * dim for dtype, heads, dim in self.states.values())


@dataclass(frozen=True, eq=False)  # arrays: identity, not an elementwise ==
class KvSnapshot:
    export: str  # export_identity of the pipeline it came from
    rows: int  # rows of the state (1 for a stream; a decode group's key has one per member)
    slots: int  # physical KV entries per row it holds, masked ones included
    stages: tuple[StageKv, ...]
    # The first slot it holds: a slice [start, start + slots) of the key's cache, exported
    # while the prompt is still prefilling (chunk-level transfer); `join` makes whole ones.
    # Only a whole snapshot (start 0, every slot: the book's `slots`) is imported.
    start: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.stages for a in s.arrays.values())


def frozen(arrays: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """`arrays` (the stage's own copies) made read-only: one snapshot may be imported many times."""
    for a in arrays.values():
        a.flags.writeable = False
    return MappingProxyType(arrays)


def snapshot(export: str, parts: list[StageKv], start: int = 0) -> KvSnapshot:
    """The stages' parts as one snapshot (of the slots from `start` on). Every stage must hold
    the same rows and slots: they differ when a step failed part way down the stages (its KV
    written on the first ones only)."""
    shapes = {a.shape[0::2] for p in parts for a in p.arrays.values()}
    if len(shapes) != 1:
        raise ShardlineError(f"the stages hold different (rows, slots) for this key: {sorted(shapes)}")
    (rows, slots), = shapes
    return KvSnapshot(export, int(rows), int(slots), tuple(parts), start)


def join(slices: list[KvSnapshot]) -> KvSnapshot:
    """Consecutive slices of one key's cache, from slot 0, as one whole snapshot. ShardlineError
    for slices that leave a gap or overlap, or come from different exports, rows or layouts."""
    if not slices:
        raise ShardlineError("no KV slices to join")
    first, at = slices[0], 0
    for s in slices:
        if s.start != at:
            raise ShardlineError(f"KV slices do not follow each other: one starts at slot {s.start}, expected {at}")
        if (s.export, s.rows, _layout(s)) != (first.export, first.rows, _layout(first)):
            raise ShardlineError("KV slices of different exports, rows or state layouts cannot be joined")
        at += s.slots
    if len(slices) == 1:
        return first
    stages = tuple(StageKv(part.first_layer, part.last_layer, frozen(
        {name: np.concatenate([s.stages[k].arrays[name] for s in slices], axis=2) for name in part.arrays}))
        for k, part in enumerate(first.stages))
    return KvSnapshot(first.export, first.rows, at, stages)


def _layout(s: KvSnapshot) -> list[tuple[int, int, list[tuple[str, np.dtype, tuple[int, ...]]]]]:
    """Each stage's layers and its arrays' names, dtypes and [rows, heads, -, dim] shapes."""
    return [(p.first_layer, p.last_layer, sorted((n, a.dtype, a.shape[:2] + a.shape[3:]) for n, a in p.arrays.items()))
            for p in s.stages]


def check(snap: KvSnapshot, export: str, layout: list[StageLayout]) -> None:
    """ShardlineError unless `snap` fits, array by array, a pipeline of `export` laid out as `layout`."""
    if snap.export != export:
        raise ShardlineError(f"a KV snapshot of export {snap.export[:24]} cannot go into export {export[:24]}")
    if snap.start != 0:
        raise ShardlineError(f"a KV slice from slot {snap.start} cannot be imported: only a whole cache can")
    got = [(s.first_layer, s.last_layer) for s in snap.stages]
    want = [(s.first_layer, s.last_layer) for s in layout]
    if got != want:
        raise ShardlineError(f"a KV snapshot of stages with layers {got} cannot go into stages with layers {want}")
    for k, (part, stage) in enumerate(zip(snap.stages, layout, strict=True)):
        _check_stage(k, part, stage, snap.rows, snap.slots)


def _check_stage(k: int, part: StageKv, stage: StageLayout, rows: int, slots: int) -> None:
    if missing := sorted(stage.states.keys() - part.arrays.keys()):
        raise ShardlineError(f"KV snapshot: stage {k} lacks state {', '.join(missing)}")
    if extra := sorted(part.arrays.keys() - stage.states.keys()):
        raise ShardlineError(f"KV snapshot: stage {k} has no state {', '.join(extra)}")
    for name, (dtype, heads, dim) in stage.states.items():
        a = part.arrays[name]
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != (rows, heads, slots, dim):
            shown = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ShardlineError(f"KV snapshot: stage {k} state {name} is {shown}; "
                                 f"expected {dtype} {[rows, heads, slots, dim]}")


@dataclass(frozen=True, eq=False)
class Handoff:
    """A stream as it moves: the stages' KV and the coordinator's book of it.

    The book must travel with the arrays: the cache's slots are physical, and some may be masked
    for ever (rejected drafts, a group's left padding), so the next token's position (RoPE) is
    not the slot count and the next step's mask is not all ones. A receiver that rebuilt them
    from the arrays alone would attend to masked slots or rotate at the wrong positions: tokens
    would differ from a run that never moved. Kept as a private copy: `book()` hands out another."""

    kv: KvSnapshot
    _book: KVBook

    def __post_init__(self) -> None:
        if self.kv.rows != 1 or self.kv.start != 0 or self._book.slots != self.kv.slots:
            raise ShardlineError(f"a book of {self._book.slots} slots for a KV snapshot of {self.kv.rows} rows "
                                 f"of {self.kv.slots} slots (one stream's state has one row)")

    def book(self) -> KVBook:
        return copy.deepcopy(self._book)


def handoff(kv: KvSnapshot, book: KVBook) -> Handoff:
    """`kv` with a copy of its stream's `book` (the sender's book may move on or be reset)."""
    return Handoff(kv, copy.deepcopy(book))
