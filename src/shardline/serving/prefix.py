"""Prefix reuse (pure): which kept KV a new prompt starts from, and which entries to keep or drop.

When a stream ends, its KV may be kept as an entry: a lease every stage holds the stream's
tokens' KV under (a compact copy: only its attended slots, in order), keyed by those tokens.
A new prompt that starts with an entry's tokens starts from a copy of the first n slots of it
(n: the common prefix, at most the prompt less its last token, whose logits are wanted) and
prefills only the rest. The coordinator decides all of this here; the stages only copy and
free leases as the plan says (pipeline/plan.py KvCopy, Release).

Invariants:
- Entries are matched only within their scope (an API key): reuse never crosses scopes.
- The bytes held never exceed the budget: an entry that does not fit once every unpinned entry
  is gone is not kept. Eviction is least-recently-used (kept or matched).
- A pinned entry (a copy from it is on its way to the stages) is never evicted.
- An entry whose tokens are a prefix of a newer one's in its scope is dropped (dominated): the
  newer one serves every prompt the older one would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from itertools import count

import numpy as np

from shardline.pipeline.plan import Lease

MIN_TOKENS = 16  # a shorter match is not worth a copy and a round trip: prefilled as usual


@dataclass
class Entry:
    lease: Lease  # what every stage holds it under
    tokens: np.ndarray  # i64: the tokens whose KV it holds, in slot order
    scope: str
    nbytes: int
    used: int = 0  # when last kept or matched (a tick of the cache's clock)
    pins: int = 0  # copies from it not yet done


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to a hit
    kept: int = 0
    evicted: int = 0

    def __add__(self, other: PrefixStats) -> PrefixStats:  # several instances' together
        return PrefixStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class PrefixCache:
    budget: int  # bytes, in the process that holds the most of an entry
    bytes_per_slot: int  # of one slot of every stage in that process
    min_tokens: int = MIN_TOKENS
    entries: list[Entry] = field(default_factory=list)
    stats: PrefixStats = field(default_factory=PrefixStats)
    _clock: count[int] = field(default_factory=count)

    @property
    def held(self) -> int:
        return sum(e.nbytes for e in list(self.entries))  # a copy: read from other threads too

    def fits(self, n: int) -> bool:
        """Whether an entry of `n` tokens may be kept at all."""
        return n >= self.min_tokens and n * self.bytes_per_slot <= self.budget

    def covers(self, tokens: Sequence[int], scope: str) -> int:
        """The longest prefix of `tokens` an entry of `scope` holds (no hit counted)."""
        ids = np.asarray(tokens, np.int64)
        return max((common_prefix(e.tokens, ids) for e in list(self.entries) if e.scope == scope), default=0)

    def match(self, prompt: Sequence[int], scope: str) -> tuple[Entry, int] | None:
        """The entry of `scope` sharing the longest prefix with `prompt`, and how many of its
        slots to start from (None: a miss). The entry is pinned: `unpin` it once the copy is done."""
        ids = np.asarray(prompt, np.int64)
        best: tuple[Entry, int] | None = None
        for e in self.entries:
            if e.scope != scope:
                continue
            n = min(common_prefix(e.tokens, ids), len(ids) - 1)
            if best is None or n > best[1]:
                best = (e, n)
        if best is None or best[1] < self.min_tokens:
            self.stats.misses += 1
            return None
        entry, n = best
        entry.used, entry.pins = next(self._clock), entry.pins + 1
        self.stats.hits += 1
        self.stats.tokens_saved += n
        return entry, n

    def unpin(self, entry: Entry) -> None:
        entry.pins = max(0, entry.pins - 1)

    def keep(self, lease: Lease, tokens: Sequence[int], scope: str) -> tuple[Entry | None, list[Lease]]:
        """Keep `tokens`' KV (being copied under `lease`) as an entry of `scope`, within the
        budget: the entry (None: not kept, `lease` among those to release) and the leases to
        release (evicted or dominated entries)."""
        ids = np.asarray(tokens, np.int64)
        nbytes = len(ids) * self.bytes_per_slot
        pinned = sum(e.nbytes for e in self.entries if e.pins)
        if not self.fits(len(ids)) or pinned + nbytes > self.budget:  # then nothing is evicted for it
            return None, [lease]
        drop = [e for e in self.entries
                if e.scope == scope and e.pins == 0 and common_prefix(e.tokens, ids) == len(e.tokens)]
        free = self._drop(drop)
        for e in sorted((e for e in self.entries if e.pins == 0), key=lambda e: e.used):
            if self.held + nbytes <= self.budget:
                break
            free += self._drop([e])
            self.stats.evicted += 1
        entry = Entry(lease, ids, scope, nbytes, used=next(self._clock))
        self.entries.append(entry)
        self.stats.kept += 1
        return entry, free

    def forget(self, entry: Entry) -> None:
        """Its copy failed: it holds nothing (its lease is closed everywhere)."""
        if entry in self.entries:
            self.entries.remove(entry)

    def clear(self) -> list[Lease]:
        """Every entry dropped (a chain broke: what the stages hold is no longer known)."""
        return self._drop(list(self.entries))

    def _drop(self, entries: list[Entry]) -> list[Lease]:
        for e in entries:
            self.entries.remove(e)
        return [e.lease for e in entries]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
