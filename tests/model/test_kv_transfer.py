"""KV transfer between two in-process pipelines over the same export (issue 13, point 7's first
step), exact precision: a stream prefilled on A, its KV exported and imported into B under
another key, decodes on B exactly the tokens it decodes on A, and those of a run that never
moved. Imports that do not fit fail their Future with a clear reason and leave nothing open."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.kv import KvSnapshot, handoff, join
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome, decode, export_kv, import_kv, prefill, run
from shardline.stage.cache import KVBook
from tests.conftest import CHAT_PROMPTS
from tests.helpers import GREEDY, greedy_ours, ok

EXACT = RunConfig(precision="exact")
N = 24  # greedy tokens decoded after the first
WAIT_S = 60.0


@pytest.fixture(scope="module")
def folder(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def pipes(folder: Path) -> Iterator[tuple[LocalPipeline, LocalPipeline]]:
    a, b = LocalPipeline(folder, EXACT), LocalPipeline(folder, EXACT)
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture(scope="module")
def prompt(folder: Path) -> list[int]:
    return ChatTokenizer(folder).encode_chat([{"role": "user", "content": CHAT_PROMPTS[2]}])


@pytest.fixture(scope="module")
def sent(pipes: tuple[LocalPipeline, LocalPipeline], prompt: list[int]) -> tuple[KvSnapshot, KVBook, int]:
    """The prompt prefilled on A under key 1 (left open): its KV, its book, its first token."""
    a, _ = pipes
    book = KVBook()
    (out,) = ok(run(a, prefill(1, book, prompt, GREEDY, first=True, last=True)))
    return export_kv(a, 1).result(WAIT_S), book, out.choices[0].token


def _greedy(pipe: LocalPipeline, key: int, book: KVBook, first: int) -> list[int]:
    tokens = [first]
    for _ in range(N):
        (out,) = ok(run(pipe, decode(key, book, [tokens[-1]], GREEDY)))
        tokens.append(out.choices[0].token)
    return tokens


def test_decoding_after_a_transfer_gives_the_tokens_of_staying(
        pipes: tuple[LocalPipeline, LocalPipeline], folder: Path, prompt: list[int],
        sent: tuple[KvSnapshot, KVBook, int]) -> None:
    a, b = pipes
    snap, book, first = sent
    assert (snap.rows, snap.slots, len(snap.stages)) == (1, len(prompt), 2)
    assert snap.nbytes == sum(x.nbytes for s in snap.stages for x in s.arrays.values()) > 0
    moved = handoff(snap, book)
    imported = import_kv(b, 7, moved.kv)
    # Not waited for: the decode steps go in behind the import and must run on its state.
    on_b = _greedy(b, 7, moved.book(), first)
    imported.result(WAIT_S)
    on_a = _greedy(a, 1, book, first)
    with LocalPipeline(folder, EXACT) as fresh:
        plain = greedy_ours(fresh, prompt, N + 1)[0]
    assert on_b == on_a == plain
    a.release(1)
    b.release(7)


def test_slices_exported_chunk_by_chunk_join_into_the_whole_cache(
        pipes: tuple[LocalPipeline, LocalPipeline], prompt: list[int]) -> None:
    """A chunk-level transfer: after each prefill chunk, the slots it added are exported (queued
    behind it, not waited for); joined, they are the whole cache's export, bit for bit, and B
    decodes from them what A decodes on the key that never moved. A start past the slots fails."""
    a, b = pipes
    book, slices, sent_slots = KVBook(), [], 0
    chunks = [prompt[i:i + 16] for i in range(0, len(prompt), 16)]
    assert len(chunks) >= 3
    for i, chunk in enumerate(chunks):
        a.submit(prefill(3, book, chunk, GREEDY, first=i == 0, last=i == len(chunks) - 1))
        slices.append(export_kv(a, 3, sent_slots))
        sent_slots = book.slots
    outs: list[Outcome] = []
    while len(outs) < len(chunks):  # the steps' outcomes (each export's Moved comes out too)
        outs += [o for o in a.outcomes(WAIT_S) if isinstance(o, Outcome)]
    assert len(outs) == len(chunks) and not any(o.failed for o in outs)
    parts = [f.result(WAIT_S) for f in slices]
    assert [(s.start, s.slots) for s in parts] == [(16 * i, len(c)) for i, c in enumerate(chunks)]
    joined, whole = join(parts), export_kv(a, 3).result(WAIT_S)
    assert (joined.start, joined.slots) == (whole.start, whole.slots) == (0, len(prompt))
    for got, want in zip(joined.stages, whole.stages, strict=True):
        assert all(np.array_equal(got.arrays[n], want.arrays[n]) for n in want.arrays)
    with pytest.raises(ShardlineError, match=f"KV from slot {len(prompt) + 1} of key 3, which holds {len(prompt)}"):
        export_kv(a, 3, len(prompt) + 1).result(WAIT_S)
    first = outs[-1].choices[0].token
    import_kv(b, 11, joined).result(WAIT_S)
    assert _greedy(b, 11, copy.deepcopy(book), first) == _greedy(a, 3, book, first)
    a.release(3)
    b.release(11)


def _refusal(b: LocalPipeline, key: int, snap: KvSnapshot) -> str:
    with pytest.raises(ShardlineError) as caught:
        import_kv(b, key, snap).result(WAIT_S)
    return str(caught.value)


def _stage1(snap: KvSnapshot, change: Callable[[dict[str, np.ndarray]], None]) -> KvSnapshot:
    """`snap` with stage 1's arrays changed by `change` (the original stays as it was)."""
    arrays = dict(snap.stages[1].arrays)
    change(arrays)
    return replace(snap, stages=(snap.stages[0], replace(snap.stages[1], arrays=arrays)))


def test_imports_that_do_not_fit_fail_and_leave_nothing_open(
        pipes: tuple[LocalPipeline, LocalPipeline], prompt: list[int], sent: tuple[KvSnapshot, KVBook, int]) -> None:
    _, b = pipes
    snap = sent[0]
    name = sorted(snap.stages[1].arrays)[0]
    shape = snap.stages[1].arrays[name].shape

    def shorter(d: dict[str, np.ndarray]) -> None:
        d[name] = d[name][:, :, 1:]

    def half(d: dict[str, np.ndarray]) -> None:
        d[name] = d[name].astype(np.float16)

    def missing(d: dict[str, np.ndarray]) -> None:
        del d[name]

    expected = f"float32 {[1, shape[1], shape[2], shape[3]]}"
    assert f"{name} is float32 {[1, shape[1], shape[2] - 1, shape[3]]}; expected {expected}" in _refusal(
        b, 8, _stage1(snap, shorter))
    assert f"{name} is float16" in _refusal(b, 8, _stage1(snap, half))
    assert f"stage 1 lacks state {name}" in _refusal(b, 8, _stage1(snap, missing))
    assert "cannot go into export" in _refusal(b, 8, replace(snap, export="0" * 64 + "/gguf/None"))

    ok(run(b, prefill(5, KVBook(), prompt[:8], GREEDY, first=True, last=True)))
    assert "key 5 is already open on stage0" in _refusal(b, 5, snap)
    # Open on stage 1 alone: stage 0 imports, stage 1 refuses, and stage 0's copy is undone
    # before the Future fails; stage 1's own key 9 is left as it was.
    b.stages[1].open(9)  # the pipeline is idle: its threads wait on their queues
    assert "stage 1: key 9 is already open on stage1" in _refusal(b, 9, snap)
    assert not b.stages[0].has(9) and b.stages[1].has(9)
    b.stages[1].close(9)
    with pytest.raises(ShardlineError, match="unknown key 4"):
        export_kv(b, 4).result(WAIT_S)

    # The stage threads still run steps; nothing but key 5 was ever left open on B.
    assert greedy_ours(b, prompt, 4)[0] == greedy_ours(pipes[0], prompt, 4)[0]
    b.release(5)
    b.shutdown()  # every step and release submitted has run on every stage (B is not used again)
    assert [s.keys() for s in b.stages] == [[], []]
