"""The KV block pool of a paged pipeline (issue 41), pure: which blocks each stream's table holds,
their reference counts, and full blocks found again by the hash of everything up to their end.

Every stage keeps its layers' KV for block b at the same index b of its own pool, so one table
per stream serves the whole pipeline: the coordinator plans for all stages at once.

Invariants:
- A block is free (in no table, no hash), cached (no table, a hash: a prefix hit may take it,
  an allocation may evict it, least recently released first: counted in `evicted`) or held
  (ref > 0; `held` counts them as they change, so a scrape reads it without a scan).
- Only full blocks are hashed, and only hashed blocks are shared; a stream writes only past its
  `written` tokens, which lie in blocks no other table holds. So sharing needs no copy on write.
- A hash covers the scope (an API key's prefix-cache scope) and every token up to the block's
  end, chained block by block: equal hashes mean equal prefixes in one scope.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shardline.errors import ShardlineError


@dataclass
class BlockTable:
    """One stream's blocks, in order, and how many of its tokens' KV they hold. Lives apart from
    the stream's identity: a replay or a move gets a new table, the stream stays."""

    blocks: list[int] = field(default_factory=list)
    written: int = 0  # tokens whose KV is in the blocks (positions 0 .. written - 1)
    hashes: list[bytes] = field(default_factory=list)  # of its leading full blocks, as far as known


@dataclass(frozen=True)
class BlockCounts:
    """A pool's blocks by state (what /metrics reports), and how many tokens a block holds."""

    held: int
    cached: int
    free: int
    block_size: int

    def __add__(self, other: BlockCounts) -> BlockCounts:  # several instances' pools together
        return BlockCounts(self.held + other.held, self.cached + other.cached, self.free + other.free,
                           self.block_size)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def chain(previous: bytes, scope: Hashable, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(repr(scope).encode())
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockPool:
    def __init__(self, blocks: int, block_size: int) -> None:
        if blocks < 1 or block_size < 1:
            raise ShardlineError(f"a KV pool of {blocks} blocks of {block_size} tokens: both must be at least 1")
        self.size, self.block_size = blocks, block_size
        self.ref = [0] * blocks
        self._free = list(range(blocks - 1, -1, -1))  # popped from the end: low ids first
        self._cached: OrderedDict[int, bytes] = OrderedDict()  # released, hashed: oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._held = 0  # blocks with ref > 0 (kept as they change: read at scrape time from any thread)
        self.evicted = 0  # cached blocks taken for new KV (their prefix no longer found)

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free, or cached (evicted on the way)."""
        return len(self._free) + len(self._cached)

    def fits(self, tables: Sequence[tuple[BlockTable, int]]) -> bool:
        """Whether every (table, tokens it will hold) can grow to that at once: admission counts
        what streams hold and will need, not a worst case."""
        need = sum(max(0, blocks_for(n, self.block_size) - len(t.blocks)) for t, n in tables)
        return need <= self.available

    def match(self, tokens: Sequence[int], scope: Hashable) -> BlockTable:
        """A new table holding the longest cached prefix of `tokens` in `scope` (full blocks, and
        never the last token: its logits must be computed). The blocks are referenced, not copied."""
        table = BlockTable()
        for block, digest in self._cached_prefix(tokens, scope):
            self._take(block)
            table.blocks.append(block)
            table.hashes.append(digest)
            table.written += self.block_size
        return table

    def covers(self, tokens: Sequence[int], scope: Hashable) -> int:
        """The tokens `match` would find cached now, nothing taken (any thread: a reading)."""
        return len(self._cached_prefix(tokens, scope)) * self.block_size

    def _cached_prefix(self, tokens: Sequence[int], scope: Hashable) -> list[tuple[int, bytes]]:
        found, previous = [], b""
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            digest = chain(previous, scope, tokens[start : start + self.block_size])
            block = self._by_hash.get(digest)
            if block is None:
                break
            found.append((block, digest))
            previous = digest
        return found

    def grow(self, table: BlockTable, tokens: int) -> None:
        """Enough blocks in `table` for `tokens` tokens (ShardlineError, nothing taken, if the pool
        has not got them: the scheduler asks `fits` first)."""
        need = blocks_for(tokens, self.block_size) - len(table.blocks)
        if need > self.available:
            raise ShardlineError(f"{need} more KV blocks asked of a pool with {self.available} available")
        for _ in range(need):
            table.blocks.append(self._fresh())

    def wrote(self, table: BlockTable, tokens: Sequence[int], scope: Hashable) -> None:
        """`tokens` (the stream's whole sequence so far) now have their KV written up to
        len(tokens): newly full blocks are hashed, so later prompts find them."""
        if len(tokens) > len(table.blocks) * self.block_size:
            raise ShardlineError(f"{len(tokens)} tokens written into {len(table.blocks)} blocks")
        table.written = len(tokens)
        while len(table.hashes) < len(tokens) // self.block_size:
            i = len(table.hashes)
            digest = chain(table.hashes[-1] if table.hashes else b"", scope,
                           tokens[i * self.block_size : (i + 1) * self.block_size])
            table.hashes.append(digest)
            block = table.blocks[i]
            if digest not in self._by_hash and block not in self._hash_of:
                self._by_hash[digest], self._hash_of[block] = block, digest

    def trim(self, table: BlockTable, tokens: int) -> None:
        """Speculation's rejected tokens dropped: the table holds `tokens` tokens, blocks past
        them released, hashes past them forgotten for this table."""
        if not 0 <= tokens <= table.written:
            raise ShardlineError(f"trim to {tokens} tokens of a table holding {table.written}")
        keep = blocks_for(tokens, self.block_size)
        for block in table.blocks[keep:]:
            self._release(block)
        del table.blocks[keep:]
        del table.hashes[tokens // self.block_size :]
        table.written = tokens

    def release_past(self, table: BlockTable, tokens: int) -> None:
        """Only the first `tokens` tokens of the table are the stream's (a verify step's rejected
        drafts past them): the blocks past them go back, unhashed, with no copy or compaction."""
        keep = blocks_for(max(0, tokens), self.block_size)
        for block in table.blocks[keep:]:
            self._release(block)
        del table.blocks[keep:]
        del table.hashes[max(0, tokens) // self.block_size :]
        table.written = min(table.written, max(0, tokens))

    def free(self, table: BlockTable) -> None:
        """The stream is done with its table: its hashed blocks stay cached for later hits (only
        blocks whose KV was written by steps that came back are hashed: `wrote`)."""
        for block in reversed(table.blocks):  # the tail is evicted first
            self._release(block)
        table.blocks.clear()
        table.hashes.clear()
        table.written = 0

    def forget(self) -> None:
        """No block may be found by its hash any more: the KV they held is gone (a broken chain's
        workers freed their pools). Cached blocks are free again; held ones stay with their tables."""
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    @property
    def cached(self) -> int:
        """Blocks in no table that a later prompt may still find by their hash."""
        return len(self._cached)

    @property
    def held(self) -> int:
        """Blocks in some table now."""
        return self._held

    def counts(self) -> BlockCounts:
        """Held, cached and free blocks now (any thread: three atomic reads, not one moment)."""
        return BlockCounts(self._held, len(self._cached), len(self._free), self.block_size)

    def writable(self, table: BlockTable) -> list[int]:
        """The blocks a step of this stream may write: those at or past its written tokens."""
        return table.blocks[table.written // self.block_size :]

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            self._cached.pop(block, None)
            self._held += 1
        self.ref[block] += 1

    def _fresh(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, digest = self._cached.popitem(last=False)
            del self._by_hash[digest], self._hash_of[block]
            self.evicted += 1
        self.ref[block] = 1
        self._held += 1
        return block

    def _release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise ShardlineError(f"KV block {block} released more often than it was taken")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self._held -= 1
            if block in self._hash_of:
                self._cached[block] = self._hash_of[block]
            else:
                self._free.append(block)
