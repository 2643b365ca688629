"""Joins of a decode group, as every stage applies them: joiners' own KV states become rows of
the group's state, left-padded to the longest (see serving/groups.py for who joins when).

Invariant: row r of a group's KV state belongs to the group's r-th stream; every row has the
same number of slots, the shorter ones left-padded with masked slots (KVBook.plan's `left` keeps
each stream's mask in step on the coordinator).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from shardline.errors import StepRefused

Key = Hashable


class KVHolder(Protocol):
    """What a merge needs of a stage (StageRunner)."""

    def has(self, key: Key) -> bool: ...
    def rows(self, key: Key) -> int: ...
    def kv(self, key: Key) -> dict[str, np.ndarray]: ...
    def set_kv(self, key: Key, kv: dict[str, np.ndarray]) -> None: ...
    def move(self, key: Key, to: Key) -> None: ...
    def close(self, key: Key) -> None: ...
    def open(self, key: Key) -> None: ...
    def compact(self, key: Key, index: np.ndarray, slots: int) -> None: ...


def check_merge(stage: KVHolder, key: Key, keep: Sequence[int], joiners: Sequence[Key]) -> str | None:
    """Why the merge cannot apply on `stage` (None when it can): every joiner open and one row,
    every kept row a row of the group's state."""
    def shown(k: Key) -> object:  # as the coordinator names it (a worker scopes keys by session)
        return k[-1] if isinstance(k, tuple) else k

    for j in joiners:
        if j == key or not stage.has(j) or stage.rows(j) != 1:
            return f"cannot merge {shown(j)} into {shown(key)}: not an open one-row state"
    if keep and (not stage.has(key) or max(keep) >= stage.rows(key)):
        return f"cannot keep rows {list(keep)} of {shown(key)}"
    return None


def apply_merge(stage: KVHolder, key: Key, keep: Sequence[int], joiners: Sequence[Key]) -> None:
    """Make the joiners rows of the group's state on `stage` (their own requests are closed).
    With no row kept, the group's old state is dropped and the first joiner's request becomes
    the group's: no copy at all when a group starts with one stream."""
    if not joiners:
        return
    if not keep:
        stage.close(key)
        stage.move(joiners[0], key)
        joiners = joiners[1:]
        if not joiners:
            return
        keep = [0]
    batch = stage.kv(key)
    stage.set_kv(key, merged(batch, keep, [stage.kv(j) for j in joiners]))
    for j in joiners:
        stage.close(j)


def merged(batch: dict[str, np.ndarray], keep: Sequence[int],
           joiners: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One KV state from the rows `keep` of `batch` and the joiners' own states (batch 1), every
    row left-padded to the longest. Arrays are [B, kv_heads, slots, head_dim]."""
    out: dict[str, np.ndarray] = {}
    for name, old in batch.items():
        slots = old.shape[2]
        width = max([slots, *(j[name].shape[2] for j in joiners)])
        new = np.zeros((len(keep) + len(joiners), old.shape[1], width, old.shape[3]), old.dtype)
        new[: len(keep), :, width - slots:] = old[list(keep)]
        for r, own in enumerate(joiners, start=len(keep)):
            new[r, :, width - own[name].shape[2]:] = own[name][0]
        out[name] = new
    return out


def prepare(stage: KVHolder, key: Key, *, first: bool, keep: Sequence[int], merge: Sequence[Key],
            compact: tuple[np.ndarray, int] | None = None) -> None:
    """What a stage does before running a step: a stream's first step opens a fresh request
    (a stale one under the same key is dropped); a decode step merges its joiners, or compacts
    the state (`compact`: the slots each row keeps and the slots they were taken from, made by
    StepInputs.compacted; never with a merge). (A step that only drops rows does it through its
    inputs' beam_idx.) Raises StepRefused, changing nothing, for a step that cannot apply."""
    if compact is not None and (first or merge or keep):
        raise StepRefused("a step that opens a request, merges or drops rows cannot also compact")
    if first:
        stage.close(key)
        stage.open(key)
    elif merge:
        if why := check_merge(stage, key, keep, merge):
            raise StepRefused(why)
        apply_merge(stage, key, keep, merge)
    elif compact is not None:
        stage.compact(key, *compact)
