"""A paged stage's batch checked against its pool (issue 41), pure: what PagedAttention would
take on trust (and crash on) is refused with a reason."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardline.errors import StepRefused
from shardline.stage.paged_batch import PagedBatch

POOL, BLOCK = 8, 4


def test_a_batch_in_the_graphs_terms() -> None:
    b = PagedBatch.of([(1, 5, [3, 1]), (6, 0, [0, 2])], logits_at=[0, 6])
    b.check(POOL, BLOCK)
    feed = b.feed()
    assert feed["position_ids"].tolist() == [5, 0, 1, 2, 3, 4, 5]
    assert feed["subsequence_begins"].tolist() == [0, 1, 7] and feed["block_indices_begins"].tolist() == [0, 2, 4]
    assert int(feed["max_context_len"]) == 6
    assert b.written(0, BLOCK).tolist() == [1] and b.written(1, BLOCK).tolist() == [0, 2]


GOOD = PagedBatch.of([(1, 5, [3, 1]), (6, 0, [0, 2])], logits_at=[0, 6])


@pytest.mark.parametrize("batch,reason", [
    (PagedBatch.of([(1, 8, [3, 1])]), "9 tokens need 3 blocks, its table has 2"),  # one block short: a crash unchecked
    (PagedBatch.of([(1, 5, [3, 8])]), "outside the pool of 8 blocks"),
    (PagedBatch.of([(1, 5, [3, -1])]), "outside the pool"),
    (PagedBatch.of([(1, 5, [3, 1]), (1, 5, [2, 1])]), "block 1 is written by sequences 0 and 1"),
    (PagedBatch.of([(1, 5, [3, 1]), (1, 0, [1])]), "block 1 is written by sequences 0 and 1"),
    (PagedBatch.of([(1, 1, [3]), (1, 4, [3, 5])]), "sequence 1 reads block 3, which sequence 0 writes"),
    (replace(GOOD, positions=np.array([5, 0, 1, 2, 3, 4, 9])), "positions do not follow its past"),
    (replace(GOOD, begins=np.array([0, 1, 9], np.int32)), "sequence starts"),
    (replace(GOOD, begins=np.array([0, 0, 7], np.int32)), "each sequence takes at least one"),
    (replace(GOOD, block_begins=np.array([0, 2, 5], np.int32)), "block table starts"),
    (replace(GOOD, past_lens=np.array([-3, 0], np.int32)), "negative past"),
    (replace(GOOD, logits_at=np.array([7])), "outside the batch of 7 tokens"),
    (replace(GOOD, past_lens=np.array([5.0, 0.0])), "past_lens: float64"),
    (replace(GOOD, block_indices=np.array([[3, 1, 0, 2]], np.int32)), "block_indices"),
    (replace(GOOD, past_lens=np.array([5], np.int32)), "one more than the sequences"),
    (PagedBatch.of([]), "0 sequences"),
])
def test_hostile_batches_are_refused(batch: PagedBatch, reason: str) -> None:
    with pytest.raises(StepRefused, match=reason):
        batch.check(POOL, BLOCK)


def test_a_sequence_past_the_context_is_refused() -> None:
    PagedBatch.of([(2, 6, [0, 1])]).check(POOL, BLOCK, context=8)
    with pytest.raises(StepRefused, match="past the context of 8"):
        PagedBatch.of([(3, 6, [0, 1, 2])]).check(POOL, BLOCK, context=8)


def test_full_blocks_are_shared_for_reading() -> None:
    # two sequences over the same full first block (a prefix hit), each writing its own tail
    PagedBatch.of([(1, 4, [0, 1]), (2, 4, [0, 2])]).check(POOL, BLOCK)
