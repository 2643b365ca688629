"""Which keys a step needs on the workers, and what it leaves there: a step whose state went with
a broken chain is lost, not sent to workers that would refuse it."""

from __future__ import annotations

import numpy as np

from shardline.config import SamplingParams
from shardline.pipeline.held import Held, needs
from shardline.pipeline.plan import DecodeStep, PrefillStep, decode, prefill
from shardline.stage.cache import KVBook

P = SamplingParams()


def _group_step(key: int, streams: tuple[int, ...], keep: tuple[int, ...], merge: tuple[int, ...]) -> DecodeStep:
    book = KVBook()
    one = book.plan([5])
    inputs = type(one).stack([one] * len(streams))
    at = np.array([[r, 0] for r in range(len(streams))], np.int64)
    return DecodeStep(key, streams, (P,) * len(streams), inputs, at, keep=keep, merge=merge)


def _first(key: int) -> PrefillStep:
    return prefill(key, KVBook(), [1, 2, 3], P, first=True, last=True)


def test_what_each_step_needs() -> None:
    assert needs(_first(3)) == set()
    assert needs(prefill(3, KVBook(), [4], P, first=False, last=True)) == {3}
    assert needs(decode(3, KVBook(), [4], P)) == {3}
    assert needs(_group_step(-1, (3, 4), keep=(0,), merge=(4,))) == {-1, 4}  # keeps a row, merges 4
    assert needs(_group_step(-1, (3, 4), keep=(), merge=(3, 4))) == {3, 4}  # a new group: joiners only
    assert needs(_group_step(-1, (3,), keep=(1,), merge=())) == {-1}  # drops a row


def test_a_stream_opens_joins_a_group_and_is_released() -> None:
    held = Held()
    assert held.missing(decode(3, KVBook(), [4], P)) == [3]
    for key in (3, 4):
        held.sent(_first(key))
    start = _group_step(-1, (3, 4), keep=(), merge=(3, 4))
    assert held.missing(start) == []
    held.sent(start)  # the joiners' own states became the group's rows
    assert -1 in held and 3 not in held and 4 not in held
    assert held.missing(_group_step(-1, (3, 4), keep=(0, 1), merge=())) == []
    held.released(-1)
    assert held.missing(_group_step(-1, (3,), keep=(0,), merge=())) == [-1]


def test_after_a_break_only_a_first_chunk_can_run() -> None:
    held = Held()
    held.sent(_first(3))
    held.sent(_first(7))
    held.clear()
    assert held.missing(prefill(7, KVBook(), [9], P, first=False, last=False)) == [7]
    assert held.missing(_group_step(-1, (3, 7), keep=(), merge=(3, 7))) == [3, 7]
    assert held.missing(_first(7)) == []


def test_a_paged_step_that_reads_blocks_the_chain_did_not_write_is_lost() -> None:
    """A paged chain holds blocks: a step may read only blocks a step sent to this chain wrote
    (its workers' pools start empty); a break forgets them all."""
    from shardline.pipeline.ragged_step import Part, RaggedStep

    held = Held(block_size=4)
    prompt = RaggedStep.of([Part(1, (1, 2, 3, 4, 5), 0, (7, 8), P, sample=True, prompt=True)])
    assert held.unwritten(prompt) is None  # it reads nothing: it writes blocks 7 and 8
    held.sent(prompt)
    token = RaggedStep.of([Part(1, (9,), 5, (7, 8), P, sample=True, prompt=False)])
    elsewhere = RaggedStep.of([Part(2, (9,), 5, (3, 4), P, sample=True, prompt=False)])
    assert held.unwritten(token) is None and held.unwritten(elsewhere) == 3
    assert held.unwritten(RaggedStep.of([Part(2, (9,), 9, (7, 8, 5), P, sample=True, prompt=False)])) == 5
    held.clear()
    assert held.unwritten(token) == 7


def test_blocks_an_import_wrote_are_held_until_a_break() -> None:
    """Disaggregated serving over workers: an import writes a stream's blocks on the chain (no
    step of it was sent), so the steps that read them run; after a break they are lost."""
    from concurrent.futures import Future

    from shardline.pipeline.kv import KvSnapshot
    from shardline.pipeline.plan import KvImport
    from shardline.pipeline.ragged_step import Part, RaggedStep
    from shardline.pipeline.remote_kv import KvHeld

    held = KvHeld(block_size=4)
    token = RaggedStep.of([Part(1, (9,), 5, (3, 6), P, sample=True, prompt=False)])
    assert held.unwritten(token) == 3
    held.imported(KvImport(1, KvSnapshot("x", 1, 4, ()), Future(), blocks=(3, 6)))
    assert held.unwritten(token) is None and 1 not in held  # blocks, not the lease
    held.clear()
    assert held.unwritten(token) == 3
