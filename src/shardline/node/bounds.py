"""What a frame may make a worker hold, checked before anything is allocated for it. Pure.

The bound (tests/model/test_worker_bounds.py checks it over every message kind):
- every row of every key holds at most `context + SLACK_SLOTS` slots: a step's mask width, a
  push's slots and a copy's slots are checked against it here, and a merge is only as wide as
  the widest key it merges;
- a frame opens at most one row: a key's first step, a push and a copy each open one row
  (messages.py), and rows enter a decode group only by merging keys already open.

So the KV a worker holds after any accepted frames is at most (frames) x one row at the bound,
and what it keeps of the frames themselves (steps held before their Route, a push's parts until
its last) is their own bytes once: `held <= 1 x frame bytes + frames x one stream's KV at
context + SLACK_SLOTS`. A merge may pad many rows at once, but every row it pads was opened by a
frame of its own. (Paged KV, issue 41, would take the padding away.)

A stage with attention sinks (a static ring that slides) holds a fixed ring whatever the
positions: there the width only sizes the step's mask, bounded as a whole.

A paged stage (issue 41) holds no rows: a session's KV is its pools, sized by its Hello, which
commit memory only as steps and moves write their blocks (stage/paged_runner.py) and so hold at
most their bytes; every session's together are bounded by `worker --kv-cache-mb` when they are
made (node/paged.py pools_for), and what a step or move may write is checked against the pool
(stage/paged_batch.py, PagedRunner's moves).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.stage.runners import Stage
from shardline.wire.messages import MAX_SLOTS, Forward, KvCopy, KvPush

# Slots a key may hold past its context: the masked slots a stream's cache keeps until a step
# compacts them (SpeculationConfig.compact_at, at most MAX_COMPACT_AT) and one step's drafts.
SLACK_SLOTS = 512


@dataclass(frozen=True)
class Bounds:
    """This worker's limits: its context, and the slots a row may hold (None: sinks, no bound)."""

    context: int
    row_slots: int | None

    @classmethod
    def of(cls, stages: list[Stage], context: int) -> Bounds:
        sliding = any(s.entry.sinks for s in stages)
        return cls(context, None if sliding else context + SLACK_SLOTS)

    def forward(self, msg: Forward) -> str | None:
        """Why the step may not run here (None: it may): a mask wider than a row may be."""
        rows = msg.hidden.shape[0]
        if self.row_slots is None:
            if rows * msg.slots > MAX_SLOTS:
                return f"Forward.slots: a mask of {rows} rows of {msg.slots} slots is past {MAX_SLOTS} cells"
            return None
        if msg.slots > self.row_slots:
            return (f"Forward.slots: a mask of {msg.slots} slots; a row holds at most {self.row_slots} here "
                    f"(the context of {self.context} plus {SLACK_SLOTS})")
        return None

    def push(self, msg: KvPush) -> str | None:
        if self.row_slots is not None and msg.slots > self.row_slots:
            return (f"KvPush.slots: {msg.slots} slots; a row holds at most {self.row_slots} here "
                    f"(the context of {self.context} plus {SLACK_SLOTS})")
        return None

    def copy(self, msg: KvCopy) -> str | None:
        """A copy is of a kept prefix's attended slots: it fits the context."""
        if msg.index.size > self.context:
            return f"KvCopy.index: {msg.index.size} slots; a copy holds at most the context of {self.context}"
        return None
