"""Every stage of a paged export (runner "paged") in this process, each on its own thread: the
ragged steps (pipeline/ragged_step.py) the paged scheduler plans go through the stages in the
order submitted, and the last stage samples. The stages hold pools of KV blocks and nothing per
stream: which blocks a stream uses is the coordinator's (serving/kv_blocks.py), so there is
nothing to open, merge, compact or release here, and a released lease is a no-op.

Every stage's pool has the same number of blocks, so one block table serves all stages. The pool
is sized by a byte budget over every stage here, and holds at least one stream at the full
context: a request the engine accepts always fits once the others are done.

A stream's KV moves by its blocks (disaggregated serving: a prefill instance's pipeline to a
decode instance's): an export reads them on every stage, an import writes a snapshot into
blocks the importer's scheduler took, each in order with the steps, as one row of slots (a
snapshot does not depend on either pool's block size or block ids).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.decoding.sampler import Choice
from shardline.errors import ShardlineError, StepRefused
from shardline.model.context import run_context
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.pipeline import metrics
from shardline.pipeline.hidden import HiddenChunk, ragged_chunks
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.kv import StageKv, StageLayout, export_identity, frozen, snapshot
from shardline.pipeline.plan import AnyStep, KvExport, KvImport, KvMove, Moved, Outcome, Placed, unfit
from shardline.pipeline.ragged_step import RaggedStep, sample
from shardline.pipeline.timing import Timing
from shardline.stage.paged_runner import PagedRunner
from shardline.stage.static_blocks import StaticBlocks


@dataclass(eq=False)
class _Move:
    """A KV move on its way down the stages: each reads (or writes) its part of the blocks."""

    item: KvExport | KvImport
    identity: str  # the export's (pipeline/kv.py): what a snapshot says it came from
    parts: list[StageKv] = field(default_factory=list)


_Item = tuple[RaggedStep, "np.ndarray", dict[int, float], float, dict[int, HiddenChunk]] | _Move | None  # None: stop


def is_paged(manifest: Manifest) -> bool:
    """Whether `manifest`'s stages run paged: paged ones, and static ones beside them (an NPU's,
    on host blocks: stage/static_blocks.py); a mix with stateful ones is refused (one pipeline
    is planned one way)."""
    kinds = {e.runner for e in manifest.stages}
    if "paged" in kinds and "stateful" in kinds:
        raise ShardlineError("an export mixes paged stages with stateful ones")
    return "paged" in kinds


def pool_blocks(per_block: int, block_size: int, context: int, kv_bytes: int, streams: int | None) -> int:
    """The blocks of every stage's pool: as many as `kv_bytes` holds at `per_block` bytes a block
    over every stage (at most `streams` streams at the full context); at least one stream's."""
    least = -(-context // block_size)
    blocks = min(kv_bytes // per_block, least * streams if streams else 1 << 30)
    if blocks < least:
        raise ShardlineError(f"a KV budget of {kv_bytes / 2**20:.0f} MiB holds {blocks} blocks of "
                             f"{block_size} tokens; one stream at the context of {context} needs {least} (a larger "
                             "--kv-cache-mb, or a smaller --context)")
    return int(blocks)


def _stages(folder: Path, manifest: Manifest, run: RunConfig, core: ov.Core,
            context: int) -> list[PagedRunner | StaticBlocks]:
    """Every stage of a paged export, each on its device: the paged ones first (their device
    chooses the block size), then the static ones on host blocks of that size."""
    n, vocab = len(manifest.stages), manifest.arch.vocab
    paged = {k: PagedRunner.load(folder, e, run.for_stage(k, n), 1, core, vocab, context)
             for k, e in enumerate(manifest.stages) if e.runner == "paged"}
    size = next(iter(paged.values())).block_size
    return [paged[k] if k in paged else StaticBlocks(folder, e, run.for_stage(k, n), size, 1, core, vocab, context)
            for k, e in enumerate(manifest.stages)]


class PagedPipeline:
    def __init__(self, folder: Path, run: RunConfig | None, kv_bytes: int, streams: int | None = None,
                 check: bool = True, summarize: bool = False) -> None:
        """Pools of as many blocks as `kv_bytes` holds over every stage (at most what `streams`
        streams at the full context need). `summarize`: each prompt chunk's outcome carries
        stage 0's output of it summarized (hidden.py: a length predictor's input)."""
        run = run or RunConfig()
        self.manifest = load_manifest(folder)
        if not is_paged(self.manifest):
            raise ShardlineError(f"{folder} is not a paged export (shardline export --paged)")
        if summarize and len(self.manifest.stages) < 2:
            raise ShardlineError(f"{folder}: one stage outputs logits, not hidden states: summarizing prompts "
                                 "needs two stages or more")
        self.summarize = summarize
        if check:
            verify(folder, self.manifest)
        core, n = ov.Core(), len(self.manifest.stages)
        self.context = run_context(self.manifest.arch, run.context)
        self.devices = [run.for_stage(k, n).device for k in range(n)]
        self.stages = _stages(folder, self.manifest, run, core, self.context)
        self.block_size = self.stages[0].block_size
        if any(s.block_size != self.block_size for s in self.stages):
            raise ShardlineError("the stages' devices chose different KV block sizes: one block table cannot "
                                 "serve them")
        self.block_bytes = sum(s.block_bytes() for s in self.stages)  # a block over every stage
        self.blocks = pool_blocks(self.block_bytes, self.block_size, self.context, kv_bytes, streams)
        for s in self.stages:
            s.allocate(self.blocks)
        self.n_stages = n
        self.outbox = Outbox()
        self._inboxes: list[queue.Queue[_Item]] = [queue.Queue() for _ in self.stages]
        self._threads: list[threading.Thread] = []

    @property
    def pool_bytes(self) -> int:
        return sum(s.pool_bytes() for s in self.stages)

    def submit(self, step: AnyStep) -> None:
        if not isinstance(step, RaggedStep):
            raise ShardlineError("a paged pipeline runs ragged steps only")
        self._start_threads()
        self._inboxes[0].put((step, step.ids, {}, time.perf_counter(), {}))

    def release(self, key: int) -> None:
        """Nothing: the stages hold no state per lease (the blocks are the scheduler's)."""

    def move(self, item: KvMove) -> None:
        """A stream's KV out of its blocks, or a snapshot into blocks, on every stage, in order
        with the steps (a move by lease, or a copy, is refused: blocks are shared, not copied)."""
        self.outbox.watch(item)
        identity = export_identity(self.manifest)
        if isinstance(item, KvExport | KvImport) and not unfit(item, identity, self.layout, paged=True):
            self._start_threads()
            self._inboxes[0].put(_Move(item, identity))
        elif not item.done.done():
            item.done.set_exception(ShardlineError("a paged pipeline copies no KV (its blocks are shared)"))

    def layout(self) -> list[StageLayout]:
        """Each stage's layers and pools (dtype, kv_heads, head_dim): what a moved stream fits."""
        return [StageLayout(e.first_layer, e.last_layer, s.kv_layout())
                for e, s in zip(self.manifest.stages, self.stages, strict=True)]

    def outcomes(self, timeout: float | None = None) -> list[Outcome | Moved]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        return False

    def placement(self) -> list[Placed]:
        return [Placed(e.first_layer, e.last_layer, "this process", device=d)
                for e, d in zip(self.manifest.stages, self.devices, strict=True)]

    def shutdown(self) -> None:
        self._inboxes[0].put(None)
        threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=30)

    def __enter__(self) -> PagedPipeline:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def _start_threads(self) -> None:
        if self._threads:
            return
        for k, stage in enumerate(self.stages):
            nxt = self._inboxes[k + 1] if k + 1 < len(self.stages) else None
            tap = self.summarize and k == 0
            t = threading.Thread(target=_stage_loop, args=(k, stage, self._inboxes[k], nxt, self.outbox, tap),
                                 daemon=True, name=f"paged-stage-{k}")
            t.start()
            self._threads.append(t)


def _stage_loop(k: int, stage: PagedRunner | StaticBlocks, inbox: queue.Queue[_Item], nxt: queue.Queue[_Item] | None,
                outbox: Outbox, tap: bool = False) -> None:
    """Stage k's thread: run each step on what the stage before gave; the last one samples. A
    step that fails fails its streams alone; the stage goes on with the next. `tap`: summarize
    each prompt chunk of stage k's output (before the output is reused)."""
    while (item := inbox.get()) is not None:
        if isinstance(item, _Move):
            _move(k, stage, item, nxt)
            continue
        step, x, graph_s, start, hidden = item
        try:
            began = time.perf_counter()
            out = stage.run(step.batch, x)
            graph_s[k] = time.perf_counter() - began
            if tap:
                hidden = ragged_chunks(step.streams, step.prompts, step.batch.begins, out)
            if nxt is not None:
                nxt.put((step, out.copy(), graph_s, start, hidden))  # the output is the request's: reused next call
            else:
                _finish(outbox, step, sample(step, out), graph_s, start, hidden)
        except Exception as e:  # noqa: BLE001 - the streams fail (with the reason); the stage goes on
            why = str(e) if isinstance(e, StepRefused | ShardlineError) else f"{type(e).__name__}: {e}"
            for s in step.streams:
                outbox.put(Outcome(s, error=f"stage {k}: {why}"))
    if nxt is not None:
        nxt.put(None)


def _move(k: int, stage: PagedRunner | StaticBlocks, move: _Move, nxt: queue.Queue[_Item] | None) -> None:
    """Stage k's part of a move; the last stage completes it. A stage that fails ends it there
    (an import's blocks written on the stages before hold nothing anyone reads: the importer
    frees them)."""
    item, e = move.item, stage.entry
    assert e is not None
    try:
        if isinstance(item, KvExport):
            move.parts.append(StageKv(e.first_layer, e.last_layer, frozen(stage.read(item.blocks, item.tokens))))
        else:
            stage.write(item.blocks, dict(item.snap.stages[k].arrays))
    except Exception as err:  # noqa: BLE001 - the move fails alone; the stage goes on
        why = str(err) if isinstance(err, ShardlineError) else f"{type(err).__name__}: {err}"
        return item.done.set_exception(ShardlineError(f"stage {k}: {why}"))
    if nxt is not None:
        return nxt.put(move)
    if isinstance(item, KvExport):
        try:
            item.done.set_result(snapshot(move.identity, move.parts, item.start))
        except ShardlineError as err:
            item.done.set_exception(err)
    else:
        item.done.set_result(None)


def _finish(outbox: Outbox, step: RaggedStep, choices: list[Choice], graph_s: dict[int, float], start: float,
            hidden: dict[int, HiddenChunk]) -> None:
    total = time.perf_counter() - start
    timing = Timing(step.phase.value, total, dict(graph_s), 0.0, 0.0, 0.0, total - sum(graph_s.values()), 0.0)
    metrics.observe(timing, len(step.streams))
    rows = step.sample_at[:, 0].tolist()
    for q, stream in enumerate(step.streams):
        mine = tuple(c for c, r in zip(choices, rows, strict=True) if r == q)
        outbox.put(Outcome(stream, mine, timing=timing, hidden=hidden.get(stream)))
