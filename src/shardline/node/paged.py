"""A Ragged step (issue 41) through a worker's paged stages, over its session's pools, and a
paged stream's KV moved by its blocks (disaggregated serving: KvPull / KvPush with `blocks`).

Each coordinator's session has pools of its own on every paged stage here (sized by the
coordinator's Hello: one block table serves every stage of the chain), allocated when it joins
and freed when its link drops. A step is checked against them before any stage runs
(stage/paged_batch.py): a table outside the pool, too short for its tokens, or a block written
by one sequence and read by another is refused (StepFailed) with every pool as it was.

A pull reads the first `tokens` tokens of its blocks on every stage, as one row of slots (as
in one process: PagedRunner.read); a push keeps its parts until the last, each checked as it
comes (node/kv.py), then writes them into its blocks on every stage, or on none: blocks outside
the session's pools or too few for the tokens are refused before any stage is written. The
blocks are the coordinator's to give (its scheduler took them for the arriving stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from shardline.decoding.masks import TokenMasks
from shardline.decoding.speculative import Drafted
from shardline.host import available_memory
from shardline.model.manifest import StageEntry
from shardline.node import kv
from shardline.node.execute import failures, tops
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.paged_runner import PagedRunner, Pool
from shardline.stage.paged_sample import choices, logits_rows
from shardline.wire.messages import Hello, KvDone, KvPart, KvPull, KvPush, Message, Ragged, Sampled


def pools_for(stages: list[PagedRunner], peer: Hello, reserved: int = 0, limit: int | None = None) -> list[Pool] | str:
    """A coordinator's pools on every stage here, or why not: a chain that is not paged, blocks
    of another size, or a pool that does not fit beside the `reserved` bytes of the other
    sessions' pools, within this worker's `limit` (--kv-cache-mb: what it was started to give;
    None, none) and within this machine's available memory. A pool costs nothing until its
    blocks are written (stage/paged_runner.py), but then up to its whole size: every session's
    may fill, so a Hello of a few hundred bytes may not claim more than the worker gives."""
    size = stages[0].block_size
    if peer.block_size != size or peer.blocks < 1:
        return (f"this worker's stages are paged, in blocks of {size} tokens; the coordinator's "
                + (f"in blocks of {peer.block_size}" if peer.block_size else "are not paged"))
    need = peer.blocks * sum(s.block_bytes() for s in stages)
    asked = f"a KV pool of {peer.blocks} blocks ({need / 2**20:.0f} MiB) does not fit this worker's"
    beside = f"beside {reserved / 2**20:.0f} MiB of other sessions' pools"
    if limit is not None and need + reserved > limit:
        return f"{asked} limit of {limit / 2**20:.0f} MiB (--kv-cache-mb) {beside}"
    if need + reserved > (free := available_memory()):
        return f"{asked} {free / 2**20:.0f} MiB available {beside}"
    return [s.pool(peer.blocks) for s in stages]


def reserved(pools: list[list[Pool] | None]) -> int:
    """The bytes of the sessions' pools."""
    return sum(p.nbytes for session in pools if session for p in session)


def batch_of(msg: Ragged) -> PagedBatch:
    """The step's batch as every stage here checks and runs it."""
    return PagedBatch(msg.positions, msg.past_lens, msg.begins, msg.block_indices, msg.block_begins,
                      np.asarray(logits_rows(msg.begins, msg.sample_at), np.int64))


def run(stages: list[PagedRunner], pools: list[Pool], msg: Ragged, batch: PagedBatch, graph_s: list[float],
        clock: Callable[[], float]) -> np.ndarray:
    """Every stage in order over the session's pools (StepRefused before the first runs for a
    batch one of them would refuse): hidden states, or on the last stage the sampled logits."""
    for stage, pool in zip(stages, pools, strict=True):
        batch.check(pool.blocks, stage.block_size, stage.context)
    x = msg.hidden.astype(np.float32, copy=False)
    for stage, pool in zip(stages, pools, strict=True):
        began = clock()
        x = stage.run(batch, x, pool)
        graph_s.append(clock() - began)
    return x


def sampled(msg: Ragged, batch: PagedBatch, logits: np.ndarray, hops: Callable[[], np.ndarray]) -> Sampled:
    """The end of the chain's answer: a choice per entry of `sample_at`, in that order."""
    drafted = None
    if msg.drafts is not None and msg.q_ids is not None and msg.q_probs is not None:
        drafted = Drafted(msg.drafts, msg.q_ids, msg.q_probs)
    masks = None if msg.allow_bits is None or msg.allow_of is None else TokenMasks(msg.allow_bits, msg.allow_of)
    made = choices(batch, msg.sample_at, msg.sampling, logits, msg.want_logits, masks, drafted)
    top_ids, top_lp = tops(made, max((p.top_logprobs for p in msg.sampling), default=0))
    logits_out = np.stack([c.logits for c in made if c.logits is not None]) if msg.want_logits and made else None
    return Sampled(0, msg.seq, np.array([c.token for c in made], np.int64),
                   np.array([c.logprob for c in made], np.float32), top_ids, top_lp, logits_out,
                   failures(made), hops())


@dataclass(frozen=True)
class _Layers:
    """A paged stage as a push's parts are checked against it (node/kv.py's Layered)."""

    entry: StageEntry
    runner: PagedRunner

    def kv_layout(self) -> kv.States:
        return self.runner.kv_layout()


def layered(stages: list[PagedRunner]) -> list[_Layers]:
    out = []
    for s in stages:
        assert s.entry is not None  # a worker's stages are loaded from its export
        out.append(_Layers(s.entry, s))
    return out


def pull(stages: list[PagedRunner], pools: list[Pool], msg: KvPull) -> Iterator[Message]:
    """A KvPart per pool of every stage (the blocks' first `tokens` tokens), then a KvDone;
    a KvDone saying why when a stage cannot read them (blocks outside its pool, too few)."""
    assert msg.blocks is not None
    if (context := stages[0].context) is not None and msg.tokens > context:
        yield KvDone(msg.seq, 0, f"a pull of {msg.tokens} tokens; a stream holds at most the context of {context}")
        return
    blocks, sent = tuple(msg.blocks.tolist()), 0
    for layers, pool in zip(layered(stages), pools, strict=True):
        e = layers.entry
        try:
            arrays = sorted(layers.runner.read(blocks, msg.tokens, pool).items())
        except Exception as err:  # noqa: BLE001 - the coordinator hears why, the worker goes on
            yield KvDone(msg.seq, sent, f"{e.name}: {err}")
            return
        for name, state in arrays:
            if state.dtype not in kv.WIRE:
                yield KvDone(msg.seq, sent, f"{e.name} pool {name} is {state.dtype}: it cannot travel")
                return
            yield KvPart(msg.seq, e.first_layer, e.last_layer, name, state)
            sent += 1
    yield KvDone(msg.seq, sent, "")


def begin(stages: list[PagedRunner], pools: list[Pool], msg: KvPush, refused: str | None) -> kv.Push:
    """A paged push under way: refused at once (its parts only counted) when its blocks do not
    fit the session's pools or hold fewer tokens than it announces."""
    assert msg.blocks is not None
    n, size = msg.blocks.size, stages[0].block_size
    if not refused and int(msg.blocks.max()) >= pools[0].blocks:
        refused = f"KV blocks up to {int(msg.blocks.max())} in a pool of {pools[0].blocks}"
    elif not refused and msg.slots > n * size:
        refused = f"{msg.slots} tokens do not fit {n} blocks of {size}"
    elif not refused and n != -(-msg.slots // size):
        refused = f"{msg.slots} tokens take {-(-msg.slots // size)} blocks of {size}, not {n}"
    return kv.begin(layered(stages), msg, refused)


def add(stages: list[PagedRunner], push: kv.Push, part: KvPart) -> None:
    kv.add(layered(stages), push, part)


def finish(stages: list[PagedRunner], pools: list[Pool], push: kv.Push) -> KvDone:
    """The pushed tokens written into their blocks on every stage (checked whole first: a
    write fails only for a fault of the device, and then the blocks hold nothing anyone reads:
    the coordinator frees them with the failed move)."""
    msg, states = push.msg, layered(stages)
    if not push.error:
        push.error = kv.incomplete(states, push)
    if push.error:
        return KvDone(msg.seq, push.got, f"blocks of key {msg.key}: {push.error}")
    assert msg.blocks is not None
    blocks = tuple(msg.blocks.tolist())
    for stage, pool, arrays in zip(stages, pools, push.arrays, strict=True):
        try:
            stage.write(blocks, arrays, pool)
        except Exception as err:  # noqa: BLE001 - the coordinator hears why, the worker goes on
            return KvDone(msg.seq, push.got, f"blocks of key {msg.key}: {type(err).__name__}: {err}")
    return KvDone(msg.seq, push.got, "")
