"""Decode groups: several streams' decode steps run as the rows of one infer call per stage.

Why: a decode call's fixed cost (weights streamed and decompressed once per call, per-node work)
dominates a small model's token; one call over B rows pays it once (BENCHMARKS.md, batching:
1.7x / 2.7x / 3.2x the tokens per second of B interleaved calls at B = 2 / 4 / 8).

A stream prefills alone, on requests of its own. Its first decode step makes it a joiner of the
least loaded group (a new group when all have MAX_ROWS members: a join copies the whole state,
11.8 MB per row at 256 slots, so groups stay small). The group merges joiners into its KV
state when it next launches (every member's token submitted, so no step of the group is in
flight on any stage). A stream that ends leaves by being left out of the next call's beam_idx.
With as many groups as stages, every stage has a group to work on at every moment
(microbatching); that pays only when the stages have cores of their own. Stages sharing one
machine's cores do best with one group (BENCHMARKS.md, decode groups): `shardline serve` uses
one group for local stages and one per stage with workers.

Invariants:
- Row r of a group's KV state belongs to `rows[r]`; every row has the same number of slots,
  the shorter ones left-padded with masked slots (KVBook.pad_left keeps each mask in step).
- A group changes (joins, leaves) only between its steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shardline.stage.cache import Decode, KVBook, StepInputs

MAX_ROWS = 8  # rows per group: past ~8 a row adds little speed, and a join copies every row


def least_loaded(sizes: list[int], max_rows: int = MAX_ROWS) -> int | None:
    """The group a new stream joins: the fewest members, the lowest index on a tie; None when
    every group is full (the caller opens another group)."""
    room = [g for g in range(len(sizes)) if sizes[g] < max_rows]
    return min(room, key=lambda g: (sizes[g], g)) if room else None


@dataclass(frozen=True)
class Launch:
    """One step of a group, as every stage must run it: first keep the rows `keep` of the KV
    state (indices into it, in order) and append the `joiners`' own states after them; then run
    one row per stream of `rows` (= the kept rows' streams, then the joiners)."""

    key: int
    rows: list[int]
    tokens: list[int]
    keep: list[int]
    joiners: list[int]

    @property
    def beam_idx(self) -> np.ndarray | None:
        """The Gather that drops rows when nothing is merged (a merge rebuilds the state)."""
        if self.joiners or self.keep == list(range(len(self.rows))):
            return None
        return np.asarray(self.keep, np.int32)


@dataclass
class Group:
    key: int  # the group's requests on every stage are open under this id (negative)
    rows: list[int] = field(default_factory=list)  # live row streams, in KV row order
    held: list[int] = field(default_factory=list)  # whose rows the KV state holds (last launch)
    joining: list[int] = field(default_factory=list)  # prefilled, not yet rows
    ready: dict[int, int] = field(default_factory=dict)  # stream -> token for the next step

    def members(self) -> list[int]:
        return self.rows + self.joining

    def complete(self) -> bool:
        """Every member has submitted its next token: the group can launch."""
        return bool(self.members()) and all(s in self.ready for s in self.members())

    def leave(self, stream: int) -> None:
        """Drop `stream`; its KV row goes at the next launch (beam_idx)."""
        if stream in self.rows:
            self.rows.remove(stream)
        if stream in self.joining:
            self.joining.remove(stream)
        self.ready.pop(stream, None)

    def launch(self) -> Launch:
        """The next step (call when `complete`); the group then holds its rows as launched."""
        keep = [self.held.index(s) for s in self.rows]
        rows = self.rows + self.joining
        # The plan gets lists of its own: the group's change as streams leave while the step runs.
        plan = Launch(self.key, list(rows), [self.ready[s] for s in rows], keep, list(self.joining))
        self.rows, self.held, self.joining, self.ready = rows, list(rows), [], {}
        return plan


class Groups:
    """A pipeline's decode groups and which one each stream is in (none: steps interleave)."""

    def __init__(self, n: int, max_rows: int = MAX_ROWS) -> None:
        self._all = [Group(key=-1 - g) for g in range(n)]
        self._max_rows = max_rows
        self._of: dict[int, Group] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._all)

    def ready(self, stream: int, token: int) -> Group | None:
        """`stream` submits its next token (joining a group first if it is new); the group when
        that completes it, to launch."""
        group = self._of.get(stream)
        if group is None:
            g = least_loaded([len(x.members()) for x in self._all], self._max_rows)
            if g is None:  # every group is full: one more
                self._all.append(Group(key=-1 - len(self._all)))
            group = self._of[stream] = self._all[-1 if g is None else g]
            group.joining.append(stream)
        group.ready[stream] = token
        return group if group.complete() else None

    def leave(self, stream: int) -> tuple[Group | None, int | None]:
        """`stream` is closed: the group its leaving completes (to launch), and the key of a group
        it left empty (whose state holds only departed rows: free it)."""
        group = self._of.pop(stream, None)
        if group is None:
            return None, None
        group.leave(stream)  # the other members may have been waiting for this one
        if group.complete():
            return group, None
        if not group.members():
            group.held = []
            return None, group.key
        return None, None


class KVHolder(Protocol):
    """What a merge needs of a stage (StageRunner)."""

    def kv(self, stream: int) -> dict[str, np.ndarray]: ...
    def set_kv(self, stream: int, kv: dict[str, np.ndarray]) -> None: ...
    def move(self, stream: int, to: int) -> None: ...
    def close(self, stream: int) -> None: ...


def apply_merge(stage: KVHolder, plan: Launch) -> None:
    """Make the joiners rows of the group's state on `stage` (their own requests are closed).
    With no row kept, the group's old state is dropped and the first joiner's request becomes
    the group's: no copy at all when a group starts with one stream."""
    joiners = plan.joiners
    if not joiners:
        return
    if not plan.keep:
        stage.close(plan.key)
        stage.move(joiners[0], plan.key)
        joiners = joiners[1:]
        if not joiners:
            return
        batch = stage.kv(plan.key)
        keep = [0]
    else:
        batch, keep = stage.kv(plan.key), plan.keep
    stage.set_kv(plan.key, merged(batch, keep, [stage.kv(s) for s in joiners]))
    for s in joiners:
        stage.close(s)


def merged(batch: dict[str, np.ndarray], keep: list[int],
           joiners: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One KV state from the rows `keep` of `batch` and the joiners' own states (batch 1), every
    row left-padded to the longest. Arrays are [B, kv_heads, slots, head_dim]."""
    out: dict[str, np.ndarray] = {}
    for name, old in batch.items():
        slots = old.shape[2]
        width = max([slots, *(j[name].shape[2] for j in joiners)])
        new = np.zeros((len(keep) + len(joiners), old.shape[1], width, old.shape[3]), old.dtype)
        new[: len(keep), :, width - slots:] = old[keep]
        for r, own in enumerate(joiners, start=len(keep)):
            new[r, :, width - own[name].shape[2]:] = own[name][0]
        out[name] = new
    return out


def batch_inputs(books: dict[int, KVBook], plan: Launch) -> StepInputs:
    """The step's inputs, one row per stream, committed to each stream's book. The joiners'
    books (and, when a joiner is longer, every book) are left-padded to the state's new width."""
    width = max(books[s].slots for s in plan.rows)
    for s in plan.rows:
        books[s].pad_left(width - books[s].slots)
    rows = [books[s].plan(Decode(t)) for s, t in zip(plan.rows, plan.tokens, strict=True)]
    for s, r in zip(plan.rows, rows, strict=True):
        books[s].commit(r)
    return StepInputs.stack(rows, plan.beam_idx)
