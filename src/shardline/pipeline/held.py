"""Which keys hold state on the workers of the current chain. Pure.

A chain that breaks takes every key's state with it (the workers free a session when its link
drops), including keys with no step in flight. A step that needs one of those keys cannot run on
the chain that replaces it: it is lost, like the steps in flight, rather than sent to workers
that would refuse it as an unknown request. The coordinator tracks what each step opens, merges
and releases exactly as every stage applies it (stage/merge.py), in the order it sends them.

A paged chain (issue 41) holds blocks, not keys: a ragged step that reads a block no step sent
to this chain wrote (its workers' pools started empty) is lost the same way, not run over zeros.
"""

from __future__ import annotations

from shardline.pipeline.plan import DecodeStep, PrefillStep, Step
from shardline.pipeline.ragged_step import RaggedStep


def needs(step: Step) -> set[int]:
    """The keys whose state `step` continues: none for a stream's first chunk (it opens a fresh
    request); a merge needs its joiners, and the group's state only if it keeps rows of it."""
    if isinstance(step, PrefillStep) and step.first:
        return set()
    if isinstance(step, DecodeStep) and step.merge:
        return set(step.merge) | ({step.key} if step.keep else set())
    return {step.key}


def reads(step: RaggedStep, block_size: int) -> set[int]:
    """The blocks `step`'s sequences read: those holding their past."""
    b = step.batch
    return {x for q in range(b.sequences) for x in b.table(q)[: -(-int(b.past_lens[q]) // block_size)].tolist()}


def writes(step: RaggedStep, block_size: int) -> set[int]:
    b = step.batch
    return {x for q in range(b.sequences) for x in b.written(q, block_size).tolist()}


class Held:
    def __init__(self, block_size: int = 0) -> None:
        self._keys: set[int] = set()
        self.block_size = block_size  # a paged chain's (0: keys, not blocks)
        self._blocks: set[int] = set()  # those written on this chain

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def missing(self, step: Step) -> list[int]:
        """The keys `step` needs that hold nothing on this chain, in order."""
        return sorted(needs(step) - self._keys)

    def unwritten(self, step: RaggedStep) -> int | None:
        """A block `step` reads that no step sent to this chain wrote (None: there is none)."""
        return min(reads(step, self.block_size) - self._blocks, default=None)

    def sent(self, step: Step | RaggedStep) -> None:
        """`step` went to this chain: its key holds state; merged streams' own keys are closed;
        a ragged step's blocks are written."""
        if isinstance(step, RaggedStep):
            self._blocks |= writes(step, self.block_size)
            return
        if isinstance(step, DecodeStep):
            self._keys -= set(step.merge)
        self._keys.add(step.key)

    def released(self, key: int) -> None:
        self._keys.discard(key)

    def clear(self) -> None:
        """The chain broke, or a new one replaced it: nothing is held."""
        self._keys.clear()
        self._blocks.clear()
