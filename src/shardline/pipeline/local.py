"""All stages of an export chained in one process (the reference for every distributed path).

Two ways to drive it:
- `step` / `advance`: one stream's step through every stage, in the caller's thread.
- `submit` / `outcomes`: several streams in flight. Stage 0 runs in the caller's thread and each
  later stage on a thread of its own, so while stage 1 works on stream A, stage 0 can work on
  stream B (OpenVINO releases the GIL inside infer). Each stream has one step in flight at most.
  With `groups` > 0, decode steps run batched: the streams of a decode group go through each
  stage as the rows of one call (groups.py); prefills still run one stream at a time.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.sampler import Choice, Sampler
from shardline.errors import ShardlineError
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.pipeline import metrics
from shardline.pipeline.groups import MAX_ROWS, Group, Groups, apply_merge, batch_inputs
from shardline.pipeline.inflight import Outbox, Outcome
from shardline.pipeline.timing import Timing
from shardline.stage.cache import Decode, KVBook, Prefill, Step, StepInputs
from shardline.stage.runner import StageRunner

# runner key (a stream, or a group's key), the streams of its rows, inputs, previous output, trace
_Work = tuple[int, list[int], StepInputs, np.ndarray, "_Trace"]


@dataclass
class _Trace:
    """Where one submitted step's time goes: each stage's graph, and the rest (host, queues)."""

    phase: str
    start: float = field(default_factory=time.perf_counter)
    graph_s: dict[int, float] = field(default_factory=dict)

    def run(self, k: int, stage: StageRunner, stream: int, inputs: StepInputs,
            hidden: np.ndarray | None = None) -> np.ndarray:
        t = time.perf_counter()
        out = stage.run(stream, inputs, hidden)
        self.graph_s[k] = time.perf_counter() - t
        return out

    def timing(self) -> Timing:
        total = time.perf_counter() - self.start
        graph = sum(self.graph_s.values())
        return Timing(self.phase, total, self.graph_s, 0.0, 0.0, 0.0, total - graph, 0.0)


class LocalPipeline:
    def __init__(self, folder: Path, run: RunConfig | None = None, check: bool = True, groups: int = 0,
                 group_rows: int = MAX_ROWS) -> None:
        run = run or RunConfig()
        self.folder = folder
        self.manifest: Manifest = load_manifest(folder)
        if check:
            verify(folder, self.manifest)
        core = ov.Core()
        self.stages = [StageRunner(folder, e, run, core) for e in self.manifest.stages]
        self._books: dict[int, KVBook] = {}
        self._samplers: dict[int, Sampler] = {}
        self._ids = count()
        self.outbox = Outbox()
        self._inboxes: list[queue.Queue[_Work]] = []  # one per stage after the first
        self.groups = Groups(groups, group_rows)

    def open(self, sampling: SamplingConfig | None = None) -> int:
        stream = next(self._ids)
        for s in self.stages:
            s.open(stream)
        self._books[stream] = KVBook()
        self._samplers[stream] = Sampler(sampling or SamplingConfig())
        return stream

    def close(self, stream: int) -> None:
        """Free the stream's KV on every stage (never while one of its steps is in flight)."""
        for s in self.stages:
            s.close(stream)
        self._books.pop(stream, None)
        self._samplers.pop(stream, None)
        launch, emptied = self.groups.leave(stream)
        if launch is not None:
            self._launch(launch)
        if emptied is not None:  # nobody left: free the departed rows' KV now
            for s in self.stages:
                s.close(emptied)

    def book(self, stream: int) -> KVBook:
        return self._books[stream]

    def _plan(self, stream: int, step: Step) -> StepInputs:
        if stream not in self._books:
            raise ShardlineError(f"unknown stream {stream}")
        return self._books[stream].plan(step)

    def step(self, stream: int, step: Step) -> np.ndarray:
        """Run one prefill or decode step through every stage; returns logits [T, vocab]."""
        inputs = self._plan(stream, step)
        hidden = None
        for stage in self.stages:
            hidden = stage.run(stream, inputs, hidden)
        self._books[stream].commit(inputs)
        assert hidden is not None
        return hidden[0]

    def advance(self, stream: int, step: Step) -> Choice:
        """One step, sampled with the stream's own (seeded) sampler."""
        return self._choose(stream, self.step(stream, step)[-1])

    def _choose(self, stream: int, row: np.ndarray) -> Choice:
        sampler = self._samplers[stream]
        choice = sampler.choose(row)
        if sampler.cfg.logprobs or sampler.cfg.want_logits:  # the row is the request's output buffer: copied before reuse
            return Choice(choice.token, choice.logprob, row.astype(np.float32, copy=True))
        return choice

    # --- several streams in flight ----------------------------------------------------------

    def submit(self, stream: int, step: Step) -> None:
        """Start one step of `stream`; its token comes out of `outcomes`."""
        if stream not in self._books:
            raise ShardlineError(f"unknown stream {stream}")
        if self.groups and isinstance(step, Decode):
            if (group := self.groups.ready(stream, step.token)) is not None:
                self._launch(group)
            return
        trace = _Trace("prefill" if isinstance(step, Prefill) else "decode")
        inputs = self._plan(stream, step)
        # Committed now: the stream's next step is planned only after this one's outcome.
        self._books[stream].commit(inputs)
        self._start(stream, [stream], inputs, trace)

    def _start(self, key: int, rows: list[int], inputs: StepInputs, trace: _Trace) -> None:
        """Stage 0 here, the later stages on their threads; one outcome per row at the end."""
        out = trace.run(0, self.stages[0], key, inputs)
        if len(self.stages) == 1:
            return self._finish(rows, out, trace)
        self._start_threads()
        # `out` is a view of stage 0's output for this key's request; stage 0 runs this key
        # again only after its outcomes, so the view stays valid until stage 1 copies it.
        self._inboxes[0].put((key, rows, inputs, out, trace))

    # --- decode groups ------------------------------------------------------------------------

    def _launch(self, group: Group) -> None:
        """One decode step of every member of `group` as one batch (joiners merged in first)."""
        plan = group.launch()
        for stage in self.stages:
            apply_merge(stage, plan)
        self._start(plan.key, plan.rows, batch_inputs(self._books, plan), _Trace("decode"))

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        return self.outbox.take(timeout)

    def _finish(self, rows: list[int], logits: np.ndarray, trace: _Trace) -> None:
        """Each row's token to the outbox (row r of the logits belongs to rows[r])."""
        timing = trace.timing()
        metrics.observe(timing)  # per-stage graph time on /metrics, as with workers
        for r, stream in enumerate(rows):
            self.outbox.put(Outcome(stream, self._choose(stream, logits[r, -1]), timing=timing))

    def _start_threads(self) -> None:
        if self._inboxes:
            return
        self._inboxes = [queue.Queue() for _ in self.stages[1:]]
        for k in range(1, len(self.stages)):
            threading.Thread(target=self._stage_loop, args=(k,), daemon=True, name=f"stage-{k}").start()

    def _stage_loop(self, k: int) -> None:
        inbox, stage = self._inboxes[k - 1], self.stages[k]
        last = k == len(self.stages) - 1
        while True:
            key, rows, inputs, hidden, trace = inbox.get()
            try:
                out = trace.run(k, stage, key, inputs, hidden)
                if last:
                    self._finish(rows, out, trace)
                else:
                    self._inboxes[k].put((key, rows, inputs, out, trace))
            except Exception as e:  # the rows fail (or were closed meanwhile); the stage goes on
                for stream in rows:
                    self.outbox.put(Outcome(stream, None, f"stage {k}: {type(e).__name__}: {e}"))
