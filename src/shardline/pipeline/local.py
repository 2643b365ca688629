"""All stages of an export in one process (the reference for every distributed path).

Each stage runs on a thread of its own, fed by a queue, so while stage 1 works on one step
stage 0 can work on the next (OpenVINO releases the GIL inside infer), and the caller's thread
(the engine's) never waits for a graph. Steps go through the stages in the order they were
submitted; each stage opens a first prefill's request and applies a decode step's merges just
before running it, so a stage's state changes in exactly the order of its steps.

Releases, KV exports and KV imports (the plan's items, pipeline/plan.py) travel the same queues
as the steps: each stage acts on its own part when the item reaches it, so an export sees every
step submitted before it and a step submitted after an import runs on the imported state. An
export or import that fails fails its `done` (ShardlineError), never the stage thread.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
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
from shardline.pipeline.hidden import HiddenChunk
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.kv import KvSnapshot, StageKv, StageLayout, export_identity, frozen, snapshot
from shardline.pipeline.plan import (
    AnyStep,
    KvCopy,
    KvExport,
    KvImport,
    KvMove,
    Moved,
    Outcome,
    Placed,
    PrefillStep,
    Release,
    Step,
    unfit,
)
from shardline.pipeline.ragged_step import RaggedStep
from shardline.pipeline.timing import Timing
from shardline.stage import executor as stage_work
from shardline.stage.runners import Stage, copy_kv, open_stage
from shardline.stage.work import StageWork


@dataclass
class _Trace:
    """Where one step's time goes: each stage's graph, and the rest (host, queues)."""

    phase: str
    start: float = field(default_factory=time.perf_counter)
    graph_s: dict[int, float] = field(default_factory=dict)
    hidden: HiddenChunk | None = None  # stage 0's output of a prefill chunk, summarized (summarize=True)

    def timing(self) -> Timing:
        total = time.perf_counter() - self.start
        graph = sum(self.graph_s.values())
        return Timing(self.phase, total, self.graph_s, 0.0, 0.0, 0.0, total - graph, 0.0)


@dataclass(frozen=True)
class _Export:
    """An export on its way down the stages: each adds its copy of the lease's KV to `parts`
    in turn; the last one resolves the item. (An import needs no more than the plan's item:
    each stage opens the lease and writes its part in turn; the last one resolves it.)"""

    item: KvExport
    export: str  # the pipeline's export identity, which the snapshot names
    parts: list[StageKv] = field(default_factory=list)

    @property
    def lease(self) -> int:
        return self.item.lease

    @property
    def done(self) -> Future[KvSnapshot]:
        return self.item.done


@dataclass(frozen=True)
class _Undo:
    """An import failed on stage `upto`: stages 0..upto-1, which opened the key for it, close it
    (in queue order, from stage 0); the last of them fails the import's Future, so no key is left
    half imported once the caller hears of the failure."""

    lease: int
    upto: int
    done: Future[None]
    error: ShardlineError


_Control = Release | _Export | KvImport | KvCopy | _Undo
_Work = tuple[Step, StageWork, "np.ndarray | None", _Trace] | _Control | None  # None stops the thread


class LocalPipeline:
    def __init__(self, folder: Path, run: RunConfig | None = None, check: bool = True,
                 summarize: bool = False) -> None:
        """`summarize`: every prefill chunk's outcome carries stage 0's output summarized
        (pipeline/hidden.py), for a prefill instance's length predictor; needs 2+ stages."""
        run = run or RunConfig()
        self.folder = folder
        self.manifest: Manifest = load_manifest(folder)
        if summarize and len(self.manifest.stages) < 2:
            raise ShardlineError(f"{folder}: one stage outputs logits, not hidden states: summarizing prompts "
                                 f"needs an export of 2 or more stages")
        self.summarize = summarize
        if check:
            verify(folder, self.manifest)
        core = ov.Core()
        vocab = self.manifest.arch.vocab
        self.context = run_context(self.manifest.arch, run.context)
        n = len(self.manifest.stages)
        self.devices = [run.for_stage(k, n).device for k in range(n)]
        self.stages = [open_stage(folder, e, run.for_stage(k, n), core, vocab, self.context)
                       for k, e in enumerate(self.manifest.stages)]
        self.n_stages = len(self.stages)
        self.outbox = Outbox()
        self._inboxes: list[queue.Queue[_Work]] = [queue.Queue() for _ in self.stages]
        self._threads: list[threading.Thread] = []
        self.identity = export_identity(self.manifest)  # what a KV snapshot of this pipeline names
        self._layout: list[StageLayout] | None = None  # what an import must fit, made on the first

    def submit(self, step: AnyStep) -> None:
        """Start `step`; one outcome per row comes out of `outcomes`."""
        if isinstance(step, RaggedStep):
            raise ShardlineError("a ragged step needs a paged export's pipeline (pipeline/paged_local.py)")
        self._start_threads()
        self._inboxes[0].put((step, step.work(), None, _Trace(step.phase.value)))

    def release(self, key: int) -> None:
        """Free `key` on every stage, after every step submitted before."""
        self._start_threads()
        self._inboxes[0].put(Release(key))

    def move(self, item: KvMove) -> None:
        """An export copies the lease's KV on every stage from its `start` (0: all of it), after
        every step submitted before (the lease stays open); it fails for a lease some stage does
        not hold, a start past its slots, or stages that disagree. An import opens its lease on
        every stage with the snapshot's state, before every step submitted after; it fails,
        leaving the lease closed everywhere, for a snapshot of another export or layout (checked
        here, before any stage sees it) or a lease already open. Either way a Moved for it comes
        out of `outcomes`."""
        self.outbox.watch(item)
        if unfit(item, self.identity, self.layout):
            return
        self._start_threads()
        self._inboxes[0].put(_Export(item, self.identity) if isinstance(item, KvExport) else item)

    def layout(self) -> list[StageLayout]:
        """Each stage's layers and state variables (dtype, kv_heads, head_dim), as an empty
        request of its compiled model reports them ([0, kv_heads, 0, head_dim])."""
        if self._layout is None:
            self._layout = [_stage_layout(stage) for stage in self.stages]
        return self._layout

    def outcomes(self, timeout: float | None = None) -> list[Outcome | Moved]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        return False  # every stage's work runs here: never free for other graph work meanwhile

    def placement(self) -> list[Placed]:
        return [Placed(s.entry.first_layer, s.entry.last_layer, "this process", device=d)
                for s, d in zip(self.stages, self.devices, strict=True)]

    def shutdown(self) -> None:
        """Stop the stage threads once every step and release submitted before has run."""
        self._inboxes[0].put(None)  # passed down the stages after everything queued before it
        threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=30)
        if not any(t.is_alive() for t in threads):  # what is left would never run: an undo queued
            for inbox in self._inboxes:  # after the stop, say; its Future must still resolve
                _abandon(inbox)

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def __del__(self) -> None:  # threads hold the stages, not the pipeline: let them end
        if getattr(self, "_inboxes", None):
            self._inboxes[0].put(None)

    def _start_threads(self) -> None:
        if self._threads:
            return
        for k, stage in enumerate(self.stages):
            tap = self.summarize and k == 0
            t = threading.Thread(target=_stage_loop, args=(k, stage, self._inboxes, self.outbox, tap),
                                 daemon=True, name=f"stage-{k}")
            t.start()
            self._threads.append(t)


def _stage_loop(k: int, stage: Stage, inboxes: list[queue.Queue[_Work]], outbox: Outbox,
                tap: bool = False) -> None:
    """Stage k's thread: prepare, run and pass on each step in order; the last stage samples.
    A step that fails fails its rows alone; the stage goes on with the next. None stops the
    thread, after the next stage has been told. `tap`: summarize each prefill chunk's output."""
    inbox, nxt = inboxes[k], inboxes[k + 1] if k + 1 < len(inboxes) else None
    while (work := inbox.get()) is not None:
        if isinstance(work, tuple):
            _step(k, stage, work, nxt, outbox, tap)
        else:
            _control(k, stage, work, nxt, inboxes[0])
    if nxt is not None:
        nxt.put(None)


def _step(k: int, stage: Stage, item: tuple[Step, StageWork, np.ndarray | None, _Trace],
          nxt: queue.Queue[_Work] | None, outbox: Outbox, tap: bool = False) -> None:
    step, work, hidden, trace = item
    try:
        graph_s: list[float] = []
        out = stage_work.run([stage], work, hidden, graph_s)
        trace.graph_s[k] = graph_s[0]
        if tap and isinstance(step, PrefillStep):
            trace.hidden = HiddenChunk.of(out)  # copied now: `out` is reused by the key's next step
        if nxt is not None:
            # `out` is a view of this stage's output for this key; the key's next step comes
            # here only after this one's outcomes, so the view lives until stage k+1 reads it.
            nxt.put((step, work, out, trace))
        else:
            finish(outbox, step, stage_work.sample(work, out), trace.timing(), trace.hidden)
    except Exception as e:  # noqa: BLE001 - the rows fail (with the reason); the stage goes on
        why = str(e) if isinstance(e, StepRefused) else f"{type(e).__name__}: {e}"
        fail(outbox, step, f"stage {k}: {why}")


def _control(k: int, stage: Stage, work: _Control, nxt: queue.Queue[_Work] | None,
             head: queue.Queue[_Work]) -> None:
    """Stage k's part of a release, export, import or undo; then pass it on (or resolve its
    Future on the last stage it concerns). A failure fails the item's Future and stops the item
    here: the stage goes on with its next work."""
    try:
        done = _apply(k, stage, work, last=nxt is None)
    except Exception as e:  # noqa: BLE001 - the item's Future fails with the reason; the stage goes on
        _failed(k, work, e, head)
        return
    if not done and nxt is not None:
        nxt.put(work)


def _apply(k: int, stage: Stage, work: _Control, last: bool) -> bool:
    """Stage k's part of `work`; whether the item ends here."""
    if isinstance(work, Release):
        stage.close(work.lease)
    elif isinstance(work, _Export):
        e, x = stage.entry, work.item
        work.parts.append(StageKv(e.first_layer, e.last_layer, frozen(stage.kv(x.lease, x.start))))
        if last:
            x.done.set_result(snapshot(work.export, work.parts, x.start))
    elif isinstance(work, KvImport | KvCopy):
        if isinstance(work, KvImport):
            write_kv(stage, work.lease, work.snap.stages[k])
        else:
            copy_kv(stage, work.src, work.dst, work.row, work.index)
        if last:
            work.done.set_result(None)
    else:
        stage.close(work.lease)
        if k == work.upto - 1:
            work.done.set_exception(work.error)
            return True
    return False


def write_kv(stage: Stage, key: int, part: StageKv) -> None:
    """Open `key` with `part` as its state, or leave the stage as it was."""
    stage.open(key)  # refuses a key already open: a live key is never overwritten (nor closed below)
    try:
        stage.set_kv(key, dict(part.arrays))
    except BaseException:
        stage.close(key)
        raise


def _failed(k: int, work: _Control, e: Exception, head: queue.Queue[_Work]) -> None:
    """Fail `work`'s Future with `e`; an import that stage 0 had got past is undone first."""
    why = str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
    error = ShardlineError(f"cannot {_VERBS[type(work)]} the KV of key {work.lease}: stage {k}: {why}")
    if isinstance(work, KvImport | KvCopy) and k > 0:
        head.put(_Undo(work.lease, k, work.done, error))
    elif not isinstance(work, Release) and not work.done.done():
        work.done.set_exception(error)


_VERBS = {Release: "release", _Export: "export", KvImport: "import", KvCopy: "copy", _Undo: "undo"}


def _abandon(inbox: queue.Queue[_Work]) -> None:
    """Fail the Futures of the items left in a stopped stage's inbox."""
    while True:
        try:
            work = inbox.get_nowait()
        except queue.Empty:
            return
        if isinstance(work, _Export | KvImport | KvCopy | _Undo) and not work.done.done():
            work.done.set_exception(ShardlineError(f"the pipeline stopped before the KV of key {work.lease} moved"))


def _stage_layout(stage: Stage) -> StageLayout:
    return StageLayout(stage.entry.first_layer, stage.entry.last_layer, stage.kv_layout())


def finish(outbox: Outbox, step: Step, choices: list[Choice], timing: Timing,
           hidden: HiddenChunk | None = None) -> None:
    """Post one outcome per row: its choices in order (a prefill chunk's one row with its
    stage-0 summary, if made)."""
    metrics.observe(timing, len(step.streams))
    rows = step.sample_at[:, 0].tolist()
    for r, stream in enumerate(step.streams):
        mine = tuple(c for c, row in zip(choices, rows, strict=True) if row == r)
        outbox.put(Outcome(stream, mine, timing=timing, hidden=hidden))


def fail(outbox: Outbox, step: Step, why: str) -> None:
    for stream in step.streams:
        outbox.put(Outcome(stream, error=why))
