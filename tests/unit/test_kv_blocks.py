"""The KV block pool (issue 41), pure: allocation, reference counts, prefix hits by shared full
blocks (scoped), eviction of cached blocks oldest first, trims and admission by blocks needed."""

from __future__ import annotations

import pytest

from shardline.errors import ShardlineError
from shardline.serving.kv_blocks import BlockCounts, BlockPool, BlockTable


def _written(pool: BlockPool, tokens: list[int], scope: str = "k") -> BlockTable:
    table = pool.match(tokens, scope)
    pool.grow(table, len(tokens))
    pool.wrote(table, tokens, scope)
    return table


def test_a_table_takes_the_blocks_its_tokens_need() -> None:
    pool = BlockPool(8, 4)
    table = _written(pool, list(range(10)))
    assert table.blocks == [0, 1, 2] and table.written == 10 and len(table.hashes) == 2
    assert pool.available == 5 and pool.ref[:3] == [1, 1, 1]
    assert pool.writable(table) == [2]  # the partial last block; full ones are never written again


def test_a_prefix_hit_shares_full_blocks_and_never_the_last_token() -> None:
    pool = BlockPool(8, 4)
    first = _written(pool, list(range(12)))
    hit = pool.match(list(range(12)), "k")  # 12 tokens: the third block holds the last one
    assert hit.blocks == first.blocks[:2] and hit.written == 8
    assert pool.ref[:3] == [2, 2, 1]
    other = pool.match([0, 1, 2, 9, 4, 5], "k")
    assert other.blocks == [] and other.written == 0


def test_scopes_do_not_share() -> None:
    pool = BlockPool(8, 4)
    _written(pool, list(range(12)), scope="alice")
    assert pool.match(list(range(12)), "bob").blocks == []
    assert pool.match(list(range(12)), "alice").written == 8


def test_freed_blocks_stay_cached_until_evicted_oldest_first() -> None:
    pool = BlockPool(4, 2)
    a = _written(pool, [1, 2, 3, 4])
    pool.free(a)
    assert pool.available == 4 and pool.ref == [0, 0, 0, 0]
    hit = pool.match([1, 2, 3, 4, 5], "k")
    assert hit.blocks == [0, 1] and pool.ref == [1, 1, 0, 0]  # found again after its stream ended
    pool.free(hit)
    assert pool.counts() == BlockCounts(held=0, cached=2, free=2, block_size=2) and pool.evicted == 0
    b = _written(pool, [7, 7, 7, 7, 7, 7, 7])  # 4 blocks: the 2 free, then both cached ones evicted
    assert sorted(b.blocks) == [0, 1, 2, 3]
    assert pool.counts() == BlockCounts(held=4, cached=0, free=0, block_size=2)
    assert pool.evicted == 2  # what /metrics counts as prefix-cache evictions
    pool.free(b)
    assert pool.match([1, 2, 3, 4, 5], "k").blocks == []
    assert pool.counts() == BlockCounts(held=0, cached=3, free=1, block_size=2)  # b's 3 full blocks kept


def test_trim_releases_the_blocks_past_the_kept_tokens() -> None:
    pool = BlockPool(8, 4)
    table = _written(pool, list(range(11)))
    pool.trim(table, 5)
    assert table.blocks == [0, 1] and table.written == 5 and len(table.hashes) == 1
    assert pool.available == 6
    with pytest.raises(ShardlineError, match="trim to 6 tokens"):
        pool.trim(table, 6)


def test_admission_counts_blocks_held_and_needed() -> None:
    pool = BlockPool(4, 4)
    a = _written(pool, list(range(6)))  # 2 blocks
    assert pool.fits([(a, 8), (BlockTable(), 8)])  # a needs none more, a new one 2
    assert not pool.fits([(a, 9), (BlockTable(), 8)])
    with pytest.raises(ShardlineError, match="3 more KV blocks"):
        pool.grow(BlockTable(), 12)
    assert pool.available == 2  # a refused growth takes nothing


def test_a_block_released_twice_is_an_error() -> None:
    pool = BlockPool(2, 2)
    table = _written(pool, [1])
    copy = BlockTable(list(table.blocks), table.written)
    pool.free(table)
    with pytest.raises(ShardlineError, match="released more often"):
        pool.free(copy)


@pytest.mark.parametrize("blocks,size", [(0, 16), (4, 0)])
def test_an_empty_pool_is_a_clear_error(blocks: int, size: int) -> None:
    with pytest.raises(ShardlineError, match="at least 1"):
        BlockPool(blocks, size)


def test_forget_drops_every_hash_and_frees_the_cached_blocks() -> None:
    """A broken chain's workers freed their pools: no kept block may be found by its hash again."""
    pool = BlockPool(8, 4)
    t = BlockTable()
    pool.grow(t, 9)
    pool.wrote(t, list(range(9)), "k")
    kept = BlockTable()
    pool.grow(kept, 4)
    pool.free(t)
    assert pool.cached == 2 and pool.held == 1
    pool.forget()
    assert pool.cached == 0 and pool.held == 1 and pool.available == 7
    assert pool.match(list(range(9)), "k").written == 0
