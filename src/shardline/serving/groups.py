"""Decode groups: several streams' decode steps run as the rows of one infer call per stage.

Why: a decode call's fixed cost (weights streamed and decompressed once per call, per-node work)
dominates a small model's token; one call over B rows pays it once (BENCHMARKS.md, batching:
1.7x / 2.7x / 3.2x the tokens per second of B interleaved calls at B = 2 / 4 / 8).

A stream prefills alone, on a request of its own. Once its first token is chosen it becomes a
joiner of the least loaded group (a new group when all have `max_rows` members: a join copies
the whole state, 11.8 MB per row at 256 slots, so groups stay small). A group launches its next
step when every member has its token and none is in flight; the step merges the joiners into
the group's KV state first (stage/merge.py, on every stage). A stream that ends leaves by being
left out of the next step's kept rows. With as many groups as stages, every stage has a group
to work on at every moment (microbatching); that pays only when the stages have cores of their
own. Stages sharing one machine's cores do best with one group (BENCHMARKS.md, decode groups).

Invariants:
- Row r of a group's KV state belongs to `held[r]` (the rows of its last step).
- A group changes (joins, leaves) only between its steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from shardline.decoding.drafts import NO_DRAFTS, Proposal, drafted
from shardline.pipeline.plan import DecodeStep
from shardline.serving.constrained import late_masks
from shardline.serving.kv_table import group_lease
from shardline.serving.speculation import GroupPace
from shardline.serving.stream import Stream
from shardline.stage.cache import StepInputs

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
    held: list[int] = field(default_factory=list)  # whose rows the KV state holds (last step)
    joining: list[int] = field(default_factory=list)  # prefilled, not yet rows
    pace: GroupPace = field(default_factory=GroupPace)  # whether drafts pay the group as a whole

    def members(self) -> list[int]:
        return self.rows + self.joining

    def leave(self, stream: int) -> None:
        """Drop `stream`; its KV row goes at the next step (it is not kept)."""
        if stream in self.rows:
            self.rows.remove(stream)
        if stream in self.joining:
            self.joining.remove(stream)

    def ready(self, streams: dict[int, Stream]) -> bool:
        """Every member has its next token and none is in flight: the group can step."""
        return bool(self.members()) and all(streams[s].idle_decoder() for s in self.members())

    def launch(self, streams: dict[int, Stream], drafts: Mapping[int, Proposal] | None = None,
               compact_at: int = 0) -> DecodeStep:
        """The next step: every member's last token (and its drafts, by stream) as one row, over
        each book as it is (the scheduler reserves it); the group then holds its rows as launched. A step without joins
        or leaves compacts the state once `compact_at` slots of every row are masked (0: never)."""
        keep = [self.held.index(s) for s in self.rows]
        rows = self.rows + self.joining
        joiners = list(self.joining)
        drops = not joiners and keep != list(range(len(self.held)))
        members = [streams[s] for s in rows]
        proposals = [(drafts or {}).get(s, NO_DRAFTS) for s in rows]
        compact = bool(compact_at) and not joiners and not drops and wasted(members) >= compact_at
        feeds = [m.feed(p.tokens) for m, p in zip(members, proposals, strict=True)]
        inputs = batch_inputs(members, feeds, np.asarray(keep, np.int32) if drops else None)
        self.rows, self.held, self.joining = rows, list(rows), []
        at = np.array([[r, t] for r, fed in enumerate(feeds) for t in range(len(fed))], np.int64)
        return DecodeStep(self.key, tuple(rows), tuple(m.params for m in members), inputs, at,
                          any(m.want_logits for m in members),
                          keep=tuple(keep) if (joiners or drops) else (), merge=tuple(streams[j].key for j in joiners),
                          compact=compact, drafted=drafted(proposals),
                          masks=late_masks([m.constraint for m in members], [p.tokens for p in proposals]))


def wasted(members: list[Stream]) -> int:
    """Slots of every row that compaction would free: the state's width past its longest row."""
    return max(m.book.slots for m in members) - max(m.book.slots - m.book.masked for m in members)


def batch_inputs(members: list[Stream], feeds: list[list[int]], beam_idx: np.ndarray | None) -> StepInputs:
    """One row per member feeding `feeds[r]` (its last token and drafts), right-padded to the
    longest feed, each over its book left-padded to the widest (a joiner longer than the group
    pads every row). Books are not committed here (pipeline.plan.reserve)."""
    width = max(m.book.slots for m in members)
    longest = max(len(f) for f in feeds)
    rows = [m.book.plan(f, longest - len(f), width - m.book.slots) for m, f in zip(members, feeds, strict=True)]
    return StepInputs.stack(rows, beam_idx)


class Groups:
    """The decode groups and which one each stream is in."""

    def __init__(self, n: int, max_rows: int = MAX_ROWS) -> None:
        self._all = [Group(key=group_lease(g)) for g in range(n)]
        self._max_rows = max_rows
        self._of: dict[int, Group] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._all)

    def has(self, stream: int) -> bool:
        return stream in self._of

    def members_of(self, stream: int) -> list[int]:
        """The members of `stream`'s group (none when it is in no group)."""
        group = self._of.get(stream)
        return group.members() if group else []

    def group_of(self, stream: int) -> Group | None:
        return self._of.get(stream)

    def by_key(self, key: int) -> Group | None:
        return next((g for g in self._all if g.key == key), None)

    def join(self, stream: int) -> Group:
        """`stream` has its first token: it joins the least loaded group (a new one if all are full)."""
        g = least_loaded([len(x.members()) for x in self._all], self._max_rows)
        if g is None:
            self._all.append(Group(key=group_lease(len(self._all))))
        group = self._of[stream] = self._all[-1 if g is None else g]
        group.joining.append(stream)
        return group

    def leave(self, stream: int) -> int | None:
        """`stream` is gone: the key of a group it left empty (whose state holds only departed
        rows: free it), else None."""
        group = self._of.pop(stream, None)
        if group is None:
            return None
        group.leave(stream)
        if group.members():
            return None
        had_state = bool(group.held)
        group.held = []
        return group.key if had_state else None
