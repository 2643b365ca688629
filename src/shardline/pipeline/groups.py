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
machine's cores do best with one group (BENCHMARKS.md, decode groups), hence `shardline serve
--decode-groups 1` by default.

Invariants:
- Row r of a group's KV state belongs to `rows[r]`; every row has the same number of slots,
  the shorter ones left-padded with masked slots (KVBook.pad_left keeps each mask in step).
- A group changes (joins, leaves) only between its steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_ROWS = 8  # rows per group: past ~8 a row adds little speed, and a join copies every row


def least_loaded(sizes: list[int], max_rows: int = MAX_ROWS) -> int | None:
    """The group a new stream joins: the fewest members, the lowest index on a tie; None when
    every group is full (the caller opens another group)."""
    room = [g for g in range(len(sizes)) if sizes[g] < max_rows]
    return min(room, key=lambda g: (sizes[g], g)) if room else None


@dataclass
class Group:
    key: int  # the group's requests on every stage are open under this id (negative)
    rows: list[int] = field(default_factory=list)  # live row streams, in KV row order
    held: list[int] = field(default_factory=list)  # whose rows the KV state holds (last launch)
    joining: list[int] = field(default_factory=list)  # prefilled, not yet rows
    ready: dict[int, int] = field(default_factory=dict)  # stream -> token for the next step

    def members(self) -> list[int]:
        return self.rows + self.joining

    def kept(self) -> list[int]:
        """Indices into the state's rows of the rows still live (the next call's beam_idx)."""
        return [self.held.index(s) for s in self.rows]

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


def merged(batch: dict[str, np.ndarray] | None, keep: list[int], joiners: list[dict[str, np.ndarray]],
           slots: int, joiner_slots: list[int]) -> tuple[dict[str, np.ndarray], int]:
    """One KV state from the rows `keep` of `batch` (`slots` each) and the joiners' own states
    (batch 1, `joiner_slots` each), every row left-padded to the longest. Returns the state and
    its slots. Arrays are [B, kv_heads, slots, head_dim]."""
    width = max([slots, *joiner_slots])
    names = joiners[0].keys() if batch is None else batch.keys()
    out: dict[str, np.ndarray] = {}
    for name in names:
        like = joiners[0][name]
        b = len(keep) + len(joiners)
        new = np.zeros((b, like.shape[1], width, like.shape[3]), like.dtype)
        if batch is not None and keep:
            new[: len(keep), :, width - slots:] = batch[name][keep]
        for j, (own, n) in enumerate(zip(joiners, joiner_slots, strict=True)):
            new[len(keep) + j, :, width - n:] = own[name][0]
        out[name] = new
    return out, width
