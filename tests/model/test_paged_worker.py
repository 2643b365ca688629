"""A paged worker's steps, in process (no sockets; issue 41): each coordinator's session gets
pools of its own, a Ragged step runs over them, and a hostile block table is refused with
nothing changed: one that points outside the pool, one too short for its tokens, a block one
sequence writes in another's table. A Forward is refused by a paged worker, a Ragged step by
a stateful one, and a coordinator whose pool does not fit or whose blocks differ is refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.node import paged
from shardline.node.session import Received, Session, check_peer
from shardline.node.worker import StageWorker
from shardline.wire.hops import no_hops
from shardline.wire.messages import MAX_BLOCKS, Hello, Message, Phase, Ragged, Role, Sampled, StepFailed
from tests.conftest import DEFAULT_SPLIT
from tests.model.test_worker_steps import Recorder, _forward

WIDTH = 576
POOL = 300  # blocks of 32 tokens: more than one stream at the context of 8192 needs


@pytest.fixture(scope="module")
def worker(shards: Callable[..., Path]) -> StageWorker:
    return StageWorker(shards("gguf", layers=DEFAULT_SPLIT, paged=True), 1, 1)


def _hello(worker: StageWorker, block_size: int | None = None, blocks: int = POOL) -> Hello:
    me = worker.hello
    assert me is not None
    return replace(me, role=Role.COORDINATOR, session="0f" * 16, first_layer=0, last_layer=me.first_layer - 1,
                   block_size=me.block_size if block_size is None else block_size, blocks=blocks)


def _session(worker: StageWorker, no: int) -> Session:
    pools = paged.pools_for(worker.shard.paged, _hello(worker))
    assert not isinstance(pools, str)
    session = Session(f"{no:032x}", no, Recorder(f"coordinator-{no}"), routed=True, pools=pools)  # type: ignore[arg-type]
    worker.sessions[session.id] = session
    return session


def _send(worker: StageWorker, session: Session, msg: Message) -> Message:
    coordinator: Any = session.coordinator
    before = len(coordinator.sent)
    worker._handle(Received(coordinator, session, msg, 0.0, 0.0))
    return coordinator.sent[before]  # type: ignore[no-any-return]


def _step(seqs: list[tuple[int, int, list[int]]], seed: int = 0, sample: bool = True) -> Ragged:
    """(new tokens, past, table) per sequence: random hidden states (seeded); each sequence's
    last token sampled."""
    t = sum(n for n, _, _ in seqs)
    hidden = np.random.default_rng(seed).standard_normal((t, WIDTH)).astype(np.float32)
    begins = np.cumsum([0] + [n for n, _, _ in seqs]).astype(np.int32)
    tables = [np.asarray(tb, np.int32) for _, _, tb in seqs]
    at = np.array([[q, n - 1] for q, (n, _, _) in enumerate(seqs)] if sample else np.zeros((0, 2)), np.int64)
    return Ragged(0, Phase.DECODE, False, [SamplingParams()] * len(seqs), np.arange(len(seqs), dtype=np.int64),
                  hidden, np.concatenate([np.arange(p, p + n) for n, p, _ in seqs]).astype(np.int64),
                  np.array([p for _, p, _ in seqs], np.int32), begins,
                  np.concatenate(tables) if tables else np.zeros(0, np.int32),
                  np.cumsum([0] + [len(x) for x in tables]).astype(np.int32), at.reshape(-1, 2),
                  None, None, None, None, None, no_hops())


def _token(reply: Message) -> list[int]:
    assert isinstance(reply, Sampled), reply
    return reply.tokens.tolist()


def test_a_hostile_table_is_refused_and_changes_nothing(worker: StageWorker) -> None:
    """A prompt writes block 0, the next step reads it. Between the two, steps that would have
    overwritten block 0 (each beside a table the pool cannot take) are refused: the next step's
    token is the one it gets with no hostile step in between."""
    clean = _session(worker, 1)
    _token(_send(worker, clean, _step([(5, 0, [0])])))
    want = _token(_send(worker, clean, _step([(1, 5, [0])], seed=1)))
    hostile = {
        "points outside the pool of 300 blocks": [(5, 0, [0]), (1, 0, [POOL])],
        "sequence 1: 40 tokens need 2 blocks, its table has 1": [(5, 0, [0]), (40, 0, [1])],
        "sequence 1 reads block 0, which sequence 0 writes": [(5, 0, [0]), (1, 32, [0, 1])],
        "block 0 is written by sequences 0 and 1": [(5, 0, [0]), (3, 0, [0])],
        "sequence 1: positions do not follow its past of 0": None,
    }
    s = _session(worker, 2)
    _token(_send(worker, s, _step([(5, 0, [0])])))
    for why, seqs in hostile.items():
        msg = _step(seqs, seed=7) if seqs else replace(_step([(5, 0, [0]), (2, 0, [1])], seed=7),
                                                        positions=np.array([0, 1, 2, 3, 4, 1, 2], np.int64))
        reply = _send(worker, s, msg)
        assert isinstance(reply, StepFailed) and why in reply.reason, (why, reply)
    assert _token(_send(worker, s, _step([(1, 5, [0])], seed=1))) == want
    for no in (1, 2):
        del worker.sessions[f"{no:032x}"]


def test_sessions_have_pools_of_their_own(worker: StageWorker) -> None:
    """Two coordinators write the same block ids with different prompts: neither sees the other's."""
    a, b = _session(worker, 3), _session(worker, 4)
    _send(worker, a, _step([(6, 0, [2])], seed=3))
    want = _token(_send(worker, a, _step([(1, 6, [2])], seed=4)))
    a2 = _session(worker, 5)
    _send(worker, a2, _step([(6, 0, [2])], seed=3))
    _send(worker, b, _step([(6, 0, [2])], seed=9))  # the same block in another session's pool
    assert _token(_send(worker, a2, _step([(1, 6, [2])], seed=4))) == want
    for no in (3, 4, 5):
        del worker.sessions[f"{no:032x}"]


def test_what_a_paged_worker_refuses(worker: StageWorker, shards: Callable[..., Path]) -> None:
    s = _session(worker, 6)
    reply = _send(worker, s, _forward(5, 0, 3, first=True))
    assert isinstance(reply, StepFailed) and "paged: it runs ragged steps (Ragged), not Forward" in reply.reason
    del worker.sessions[s.id]
    me = worker.hello
    assert me is not None
    assert "KV layout mismatch: the coordinator's stages are not paged, this worker's paged in blocks of 32" in str(
        check_peer(me, _hello(worker, block_size=0), {}))
    assert "are paged in blocks of 16 tokens" in str(check_peer(me, _hello(worker, block_size=16), {}))
    assert check_peer(me, _hello(worker), {}) is None
    too_big = paged.pools_for(worker.shard.paged, _hello(worker, blocks=MAX_BLOCKS))
    assert isinstance(too_big, str) and f"a KV pool of {MAX_BLOCKS} blocks" in too_big and "does not fit" in too_big
    stateful = StageWorker(shards("gguf", layers=DEFAULT_SPLIT), 1, 1)
    plain = Session("1" * 32, 7, Recorder(), routed=True)  # type: ignore[arg-type]
    stateful.sessions[plain.id] = plain
    reply = _send(stateful, plain, _step([(5, 0, [0])]))
    assert isinstance(reply, StepFailed) and "not paged: it runs Forward steps, not Ragged" in reply.reason


def test_blocks_read_out_and_written_elsewhere_hold_the_same_kv(worker: StageWorker) -> None:
    """A move's two ends (disaggregated serving): a stream's blocks read out as one row of slots
    and written into other blocks of another pool read back the same; blocks that are not
    distinct blocks of the pool, or too few for the tokens, are refused."""
    from shardline.errors import ShardlineError
    from shardline.stage.paged_batch import PagedBatch

    stage = worker.shard.paged[0]
    here, there = stage.pool(8), stage.pool(8)
    hidden = np.random.default_rng(3).standard_normal((40, WIDTH)).astype(np.float32)
    stage.run(PagedBatch.of([(40, 0, (2, 5))], logits_at=[39]), hidden, here)
    kv = stage.read((2, 5), 40, here)
    assert {a.shape for a in kv.values()} == {(1, 3, 40, 64)} and any(np.abs(a).sum() > 0 for a in kv.values())
    stage.write((7, 1), kv, there)
    assert all(np.array_equal(stage.read((7, 1), 40, there)[n], a) for n, a in kv.items())
    for blocks, tokens, why in [((2, 2), 10, "not distinct blocks of a pool of 8"),
                                ((8,), 5, "not distinct blocks of a pool of 8"),
                                ((2,), 40, "40 tokens do not fit 1 blocks of 32")]:
        with pytest.raises(ShardlineError, match=why):
            stage.read(blocks, tokens, here)


def test_sessions_pools_together_fit_the_worker_s_memory(worker: StageWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's pages are committed only as its blocks are written, so each coordinator's Hello
    is checked against the memory beside the pools the other sessions already hold: a few
    hundred bytes may not reserve more than the machine has."""
    one = POOL * sum(s.block_bytes() for s in worker.shard.paged)
    monkeypatch.setattr(paged, "available_memory", lambda: one * 3 // 2)
    first = paged.pools_for(worker.shard.paged, _hello(worker))
    assert not isinstance(first, str)
    second = paged.pools_for(worker.shard.paged, _hello(worker), paged.reserved([first, None]))
    assert isinstance(second, str) and "does not fit" in second and "beside" in second
    assert not isinstance(paged.pools_for(worker.shard.paged, _hello(worker, blocks=POOL // 4),
                                          paged.reserved([first])), str)


def test_a_worker_gives_its_sessions_pools_at_most_its_kv_limit(worker: StageWorker) -> None:
    """`worker --kv-cache-mb`: every session's pools together within the limit the worker was
    started with; a Hello past it (alone, or beside the pools the others hold) is refused naming
    the limit and the flag, and one that fits beside them is not."""
    block = sum(s.block_bytes() for s in worker.shard.paged)
    limit = POOL * block
    first = paged.pools_for(worker.shard.paged, _hello(worker), 0, limit)
    assert not isinstance(first, str) and [p.nbytes for p in first] == [limit]
    mib = f"{limit / 2**20:.0f}"
    assert paged.pools_for(worker.shard.paged, _hello(worker, blocks=POOL + 1), 0, limit) == (
        f"a KV pool of {POOL + 1} blocks ({(POOL + 1) * block / 2**20:.0f} MiB) does not fit this worker's "
        f"limit of {mib} MiB (--kv-cache-mb) beside 0 MiB of other sessions' pools")
    assert paged.pools_for(worker.shard.paged, _hello(worker, blocks=1), paged.reserved([first]), limit) == (
        f"a KV pool of 1 blocks ({block / 2**20:.0f} MiB) does not fit this worker's limit of {mib} MiB "
        f"(--kv-cache-mb) beside {mib} MiB of other sessions' pools")
    half = paged.pools_for(worker.shard.paged, _hello(worker, blocks=POOL // 2), 0, limit)
    assert not isinstance(half, str)
    assert not isinstance(paged.pools_for(worker.shard.paged, _hello(worker, blocks=POOL // 2),
                                          paged.reserved([half]), limit), str)


def test_a_step_writes_its_blocks_into_the_pool_s_own_arrays(worker: StageWorker) -> None:
    """A pool's arrays are the very memory the plugin runs PagedAttention over (shared, not
    copied: so a pool commits only the pages its written blocks hold): a step's KV lands in its
    table's blocks of those arrays, every other block still zeros, and a move reads it there.
    The warm-up at load wrote none of the runner's own pool."""
    from shardline.stage.paged_batch import PagedBatch

    stage = worker.shard.paged[0]
    assert not any(np.any(a) for a in stage.own.arrays)  # its warm-up ran on a scratch pool
    pool = stage.pool(8)
    hidden = np.random.default_rng(4).standard_normal((40, WIDTH)).astype(np.float32)
    stage.run(PagedBatch.of([(40, 0, (6, 3))], logits_at=[39]), hidden, pool)
    assert pool.arrays and all(a.shape[0] == 8 for a in pool.arrays)
    written = [int(b) for b in range(8) if any(np.any(a[b]) for a in pool.arrays)]
    assert written == [3, 6]
    kv = stage.read((6, 3), 40, pool)
    for name, a in zip(stage.kv_layout(), pool.arrays, strict=True):  # both in the graph's input order
        row = a[[6, 3]].transpose(1, 0, 2, 3).reshape(a.shape[1], -1, a.shape[3])[None, :, :40]
        assert np.array_equal(kv[name], row)


def _sent(worker: StageWorker, session: Session, *msgs: Message) -> list[Message]:
    """What the worker sends its coordinator for `msgs` (a pull's parts and done, a push's done)."""
    coordinator: Any = session.coordinator
    before = len(coordinator.sent)
    for msg in msgs:
        worker._handle(Received(coordinator, session, msg, 0.0, 0.0))
    return list(coordinator.sent[before:])


def test_blocks_pulled_and_pushed_over_the_link_hold_the_same_kv(worker: StageWorker,
                                                                 shards: Callable[..., Path]) -> None:
    """Protocol 14's paged moves through the worker's dispatch: a stream's blocks pulled (a
    KvPart per pool, as one row of its tokens) and pushed into other blocks of another session's
    pool: the step after reads them and gives the token it gives on the blocks they came from.
    Hostile moves get a KvDone saying why, with the session's blocks unchanged: blocks outside the
    pool, too few for the tokens, a part of another shape, a move by key to a paged worker and
    one by blocks to a stateful worker."""
    from shardline.wire.messages import KvCopy, KvDone, KvPart, KvPull, KvPush

    def blocks(*ids: int) -> np.ndarray:
        return np.asarray(ids, np.int32)

    a, b = _session(worker, 8), _session(worker, 9)
    _send(worker, a, _step([(40, 0, [2, 5])], seed=5))
    want = _token(_send(worker, a, _step([(1, 40, [2, 5])], seed=6)))
    *parts, done = _sent(worker, a, KvPull(1, 77, blocks=blocks(2, 5), tokens=40))
    n = sum(len(s.kv_layout()) for s in worker.shard.paged)
    assert done == KvDone(1, n, "") and len(parts) == n
    assert all(isinstance(p, KvPart) and p.state.shape == (1, 3, 40, 64) for p in parts)
    hostile: list[tuple[list[Message], str]] = [
        ([KvPull(2, 77, blocks=blocks(POOL), tokens=5)], f"not distinct blocks of a pool of {POOL}"),
        ([KvPull(3, 77, blocks=blocks(1), tokens=40)], "40 tokens do not fit 1 blocks of 32"),
        ([KvPull(4, 77)], "this worker's stages are paged: a KV move names blocks"),
        ([KvCopy(5, 77, 78, 0, np.arange(3, dtype=np.int64))], "a paged worker copies no KV"),
        ([KvPush(6, 78, 1, 40, n, blocks(POOL)), *parts], f"KV blocks up to {POOL} in a pool of {POOL}"),
        ([KvPush(7, 78, 1, 40, n, blocks(9)), *parts], "40 tokens do not fit 1 blocks of 32"),
        ([KvPush(8, 78, 1, 40, n, blocks(7, 1)), replace(parts[0], state=parts[0].state[:, :, :39]), *parts[1:]],
         "is float32 [1, 3, 39, 64]; expected float32 [1, 3, 40, 64]"),
        ([KvPush(9, 78, 1, 40, n), *parts], "this worker's stages are paged: a KV move names blocks")]
    for msgs, why in hostile:
        seq = msgs[0].seq  # type: ignore[attr-defined]
        replies = _sent(worker, b, *[replace(m, seq=seq) if isinstance(m, KvPart) else m for m in msgs])
        assert len(replies) == 1 and isinstance(replies[0], KvDone) and why in replies[0].error, (why, replies)
    pushed = _sent(worker, b, KvPush(10, 78, 1, 40, n, blocks(7, 1)), *[replace(p, seq=10) for p in parts])
    assert pushed == [KvDone(10, n, "")]
    assert _token(_send(worker, b, _step([(1, 40, [7, 1])], seed=6))) == want
    stateful = StageWorker(shards("gguf", layers=DEFAULT_SPLIT), 1, 1)
    plain = Session("2" * 32, 10, Recorder(), routed=True)  # type: ignore[arg-type]
    stateful.sessions[plain.id] = plain
    for msgs in ([KvPull(1, 5, blocks=blocks(0), tokens=3)], [KvPush(2, 5, 1, 40, n, blocks(0)), *parts]):
        seq = msgs[0].seq  # type: ignore[attr-defined]
        replies = _sent(stateful, plain, *[replace(m, seq=seq) if isinstance(m, KvPart) else m for m in msgs])
        assert len(replies) == 1 and isinstance(replies[0], KvDone), replies
        assert "this worker's stages are not paged: a KV move names no blocks" in replies[0].error
    for no in (8, 9):
        del worker.sessions[f"{no:032x}"]


def test_a_small_move_frame_cannot_make_a_worker_read_or_write_a_pool(worker: StageWorker) -> None:
    """A move is one stream's blocks for its tokens: a pull or push naming more blocks than its
    tokens take (a few bytes a block, each a whole block of every layer to copy or zero) or a pull
    of more tokens than a stream holds is answered with why, nothing read or written (more blocks
    than tokens is refused on decode: tests/unit/test_wire_kv.py)."""
    from shardline.wire.messages import KvDone, KvPart, KvPull, KvPush

    s = _session(worker, 11)
    _send(worker, s, _step([(40, 0, [2, 5])], seed=5))
    many = np.arange(POOL, dtype=np.int32)
    n = sum(len(st.kv_layout()) for st in worker.shard.paged)
    *parts, _ = _sent(worker, s, KvPull(1, 77, blocks=np.asarray([2, 5], np.int32), tokens=40))
    for msgs, why in [([KvPull(2, 77, blocks=many, tokens=POOL)], f"{POOL} tokens take 10 blocks of 32, not {POOL}"),
                      ([KvPull(3, 77, blocks=many[:257], tokens=257 * 32)], "at most the context of 8192"),
                      ([KvPush(4, 78, 1, 40, n, many[:40]), *[replace(p, seq=4) for p in parts]],
                       "40 tokens take 2 blocks of 32, not 40")]:
        replies = _sent(worker, s, *msgs)
        assert len(replies) == 1 and isinstance(replies[0], KvDone) and why in replies[0].error, (why, replies)
    assert all(isinstance(p, KvPart) for p in parts)
    del worker.sessions[s.id]
