"""The leases of one pipeline's KV states (pure).

A lease is the key every stage holds a state under. A stream's own state gets a fresh lease
when it starts, when it is replayed and when a decode instance adopts it (the stream keeps its
id); a decode group's state has a fixed negative lease, reused after the group empties. A lease
freed here is released on every stage by the next plan (Plan.releases), after every step
submitted before it. One table per engine: leases are unique on its pipeline, not across them.
"""

from __future__ import annotations

from itertools import count

from shardline.pipeline.plan import Lease


def group_lease(group: int) -> Lease:
    """Decode group `group`'s lease (negative: never a stream's)."""
    return Lease(-1 - group)


class KvTable:
    def __init__(self) -> None:
        self._next = count()
        self._freed: list[Lease] = []

    def lease(self) -> Lease:
        """A fresh lease for a stream's own state."""
        return Lease(next(self._next))

    def free(self, lease: Lease) -> None:
        """The state under `lease` is no longer needed: release it with the next plan."""
        self._freed.append(lease)

    def take_freed(self) -> list[Lease]:
        """The leases freed since the last call, in the order they were freed."""
        out, self._freed = self._freed, []
        return out
