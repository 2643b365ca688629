"""The leases of one pipeline's KV states and the books of them (pure).

A lease is the key every stage holds a state under; its book (stage/cache.py KVBook: slots,
positions, the mask) is what the coordinator knows of that state. The table makes both and
drops a book when its lease is freed; a stream record holds its current lease and book.

A stream's own state gets a fresh lease when it starts, when it is replayed and when a decode
instance adopts it (the stream keeps its id); a decode group's state has a fixed negative
lease, reused after the group empties. A lease freed here is released on every stage by the
next plan (Plan.releases), after every step submitted before it. KV moves (a prefill
instance's exports, a decode instance's imports) are asked for here and leave with the next
plan too. One table per engine: leases are unique on its pipeline, not across them.
"""

from __future__ import annotations

from concurrent.futures import Future
from itertools import count

import numpy as np

from shardline.pipeline.kv import KvSnapshot
from shardline.pipeline.plan import KvCopy, KvExport, KvImport, Lease
from shardline.stage.cache import KVBook


def group_lease(group: int) -> Lease:
    """Decode group `group`'s lease (negative: never a stream's)."""
    return Lease(-1 - group)


class KvTable:
    def __init__(self) -> None:
        self._next = count()
        self.books: dict[Lease, KVBook] = {}  # every lease given and not freed (a group's has none)
        self._freed: list[Lease] = []
        self._exports: list[KvExport] = []
        self._imports: list[KvImport] = []
        self._copies: list[KvCopy] = []

    def lease(self, book: KVBook | None = None) -> Lease:
        """A fresh lease for a stream's own state, with its book: a fresh one (an empty cache),
        or `book` (a cache imported with it)."""
        lease = Lease(next(self._next))
        self.books[lease] = book or KVBook()
        return lease

    def book(self, lease: Lease) -> KVBook:
        return self.books[lease]

    def slots(self) -> int:
        """The KV slots the leased states hold (a group pads its rows to the longest: not counted)."""
        return sum(b.slots for b in self.books.values())

    def free(self, lease: Lease) -> None:
        """The state under `lease` is no longer needed: release it with the next plan."""
        self._freed.append(lease)
        self.books.pop(lease, None)

    def take_freed(self) -> list[Lease]:
        """The leases freed since the last call, in the order they were freed."""
        out, self._freed = self._freed, []
        return out

    def export(self, lease: Lease, start: int = 0) -> Future[KvSnapshot]:
        """`lease`'s KV from slot `start` on, out with the next plan (before its releases)."""
        self._exports.append(x := KvExport(lease, start))
        return x.done

    def import_(self, snap: KvSnapshot, book: KVBook) -> tuple[Lease, Future[None]]:
        """A fresh lease opened with `snap`'s state by the next plan (before its steps); `book`
        is the book of that state."""
        self._imports.append(y := KvImport(self.lease(book), snap))
        return Lease(y.lease), y.done

    def take_moves(self) -> tuple[tuple[KvExport, ...], tuple[KvImport, ...]]:
        """The KV moves asked for since the last call, in the order they were asked."""
        out = tuple(self._exports), tuple(self._imports)
        self._exports, self._imports = [], []
        return out

    def copy(self, src: Lease, index: np.ndarray, row: int = 0, to: Lease | None = None) -> tuple[Lease, Future[None]]:
        """A lease opened by the next plan (before its releases and steps) with the slots `index`
        of row `row` of `src`'s state: a fresh lease, or `to` (given and not opened yet). Its
        book becomes a cache of those slots, every one attended."""
        lease = self.lease() if to is None else to
        self.books[lease] = KVBook.filled(len(index))
        self._copies.append(c := KvCopy(src, lease, np.asarray(index, np.int64), row))
        return lease, c.done

    def take_copies(self) -> tuple[KvCopy, ...]:
        out, self._copies = tuple(self._copies), []
        return out
