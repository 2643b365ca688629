"""All stages of an export in one process (the reference for every distributed path).

Each stage runs on a thread of its own, fed by a queue, so while stage 1 works on one step
stage 0 can work on the next (OpenVINO releases the GIL inside infer), and the caller's thread
(the engine's) never waits for a graph. Steps go through the stages in the order they were
submitted; each stage opens a first prefill's request and applies a decode step's merges just
before running it, so a stage's state changes in exactly the order of its steps.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.decoding.sampler import choose_at
from shardline.errors import StepRefused
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.pipeline import metrics
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.plan import DecodeStep, Outcome, PrefillStep, Step
from shardline.pipeline.timing import Timing
from shardline.stage.cache import StepInputs, logits_index
from shardline.stage.merge import prepare as prepare_stage
from shardline.stage.runner import StageRunner


@dataclass
class _Trace:
    """Where one step's time goes: each stage's graph, and the rest (host, queues)."""

    phase: str
    start: float = field(default_factory=time.perf_counter)
    graph_s: dict[int, float] = field(default_factory=dict)

    def timing(self) -> Timing:
        total = time.perf_counter() - self.start
        graph = sum(self.graph_s.values())
        return Timing(self.phase, total, self.graph_s, 0.0, 0.0, 0.0, total - graph, 0.0)


@dataclass(frozen=True)
class _Release:
    key: int


_Work = tuple[Step, "np.ndarray | None", _Trace] | _Release | None  # None stops the thread


class LocalPipeline:
    def __init__(self, folder: Path, run: RunConfig | None = None, check: bool = True) -> None:
        run = run or RunConfig()
        self.folder = folder
        self.manifest: Manifest = load_manifest(folder)
        if check:
            verify(folder, self.manifest)
        core = ov.Core()
        vocab = self.manifest.arch.vocab
        self.stages = [StageRunner(folder, e, run, core, vocab) for e in self.manifest.stages]
        self.n_stages = len(self.stages)
        self.outbox = Outbox()
        self._inboxes: list[queue.Queue[_Work]] = [queue.Queue() for _ in self.stages]
        self._threads: list[threading.Thread] = []

    def submit(self, step: Step) -> None:
        """Start `step`; one outcome per row comes out of `outcomes`."""
        self._start_threads()
        self._inboxes[0].put((step, None, _Trace(step.phase.value)))

    def release(self, key: int) -> None:
        """Free `key` on every stage, after every step submitted before."""
        self._start_threads()
        self._inboxes[0].put(_Release(key))

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        return False  # every stage's work runs here: never free for other graph work meanwhile

    def shutdown(self) -> None:
        """Stop the stage threads once every step and release submitted before has run."""
        self._inboxes[0].put(None)  # passed down the stages after everything queued before it
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

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
            nxt = self._inboxes[k + 1] if k + 1 < len(self.stages) else None
            t = threading.Thread(target=_stage_loop, args=(k, stage, self._inboxes[k], nxt, self.outbox),
                                 daemon=True, name=f"stage-{k}")
            t.start()
            self._threads.append(t)


def _stage_loop(k: int, stage: StageRunner, inbox: queue.Queue[_Work], nxt: queue.Queue[_Work] | None,
                outbox: Outbox) -> None:
    """Stage k's thread: prepare, run and pass on each step in order; the last stage samples.
    A step that fails fails its rows alone; the stage goes on with the next. None stops the
    thread, after the next stage has been told."""
    while (work := inbox.get()) is not None:
        if isinstance(work, _Release):
            stage.close(work.key)
            if nxt is not None:
                nxt.put(work)
            continue
        step, hidden, trace = work
        try:
            inputs = prepare(stage, step)
            if nxt is None:
                index, pick = logits_index(step.sample_at, inputs.rows)
                inputs = replace(inputs, logits_index=index)
            start = time.perf_counter()
            out = stage.run(step.key, inputs, hidden)
            trace.graph_s[k] = time.perf_counter() - start
            if nxt is not None:
                # `out` is a view of this stage's output for this key; the key's next step comes
                # here only after this one's outcomes, so the view lives until stage k+1 reads it.
                nxt.put((step, out, trace))
            else:
                finish(outbox, step, out, pick, trace.timing())
        except Exception as e:  # noqa: BLE001 - the rows fail (with the reason); the stage goes on
            why = str(e) if isinstance(e, StepRefused) else f"{type(e).__name__}: {e}"
            fail(outbox, step, f"stage {k}: {why}")
    if nxt is not None:
        nxt.put(None)


def prepare(stage: StageRunner, step: Step) -> StepInputs:
    """Ready `stage`'s state for `step` (open, merge or compact); the inputs to run it with."""
    if isinstance(step, DecodeStep):
        compact, inputs = step.run_inputs()
        prepare_stage(stage, step.key, first=False, keep=step.keep, merge=step.merge, compact=compact)
        return inputs
    prepare_stage(stage, step.key, first=isinstance(step, PrefillStep) and step.first, keep=(), merge=())
    return step.inputs


def finish(outbox: Outbox, step: Step, logits: np.ndarray, pick: np.ndarray, timing: Timing) -> None:
    """Sample every asked position, then post one outcome per row (its choices in order)."""
    drafted = step.drafted if isinstance(step, DecodeStep) else None
    choices = choose_at(logits, step.sample_at, pick, step.inputs.position_ids, list(step.sampling),
                        step.want_logits, drafted)
    metrics.observe(timing)
    rows = step.sample_at[:, 0].tolist()
    for r, stream in enumerate(step.streams):
        mine = tuple(c for c, row in zip(choices, rows, strict=True) if row == r)
        outbox.put(Outcome(stream, mine, timing=timing))


def fail(outbox: Outbox, step: Step, why: str) -> None:
    for stream in step.streams:
        outbox.put(Outcome(stream, error=why))
