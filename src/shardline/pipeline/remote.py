"""The coordinator as a node: stage 0 here, later stages on workers.

Daisy chain (default): hidden states go worker to worker; only the last worker talks back, with
the chosen tokens and their log-probabilities. Star (for comparison, as the paper's measured
code): every worker returns its hidden states to the coordinator, which sends them to the next.

Stage 0 runs on a thread of its own that takes the submitted steps in order: it prepares and
runs each on stage 0 and sends it down the chain as a `Forward` (the mask as runs of ones).
Releases go through the same thread, so a key is freed on every stage after every step sent
before. The coordinator's chain is a session (a random id in its Hello): workers keep its
streams apart from any other coordinator's and free them all when its link drops.

A worker that lacks its shard asks for it during the handshake and the coordinator sends it
from its own export folder (node/delivery.py). Every token comes back with the durations each
hop measured; `Outcome.timing` breaks its round trip down (timing.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path

import numpy as np

from shardline.config import RunConfig
from shardline.decoding.sampler import Choice
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest, verify
from shardline.pipeline import metrics
from shardline.pipeline.chain import Delivered, open_chain
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.local import prepare
from shardline.pipeline.plan import DecodeStep, Outcome, PrefillStep, Step
from shardline.pipeline.timing import breakdown
from shardline.stage.runner import StageRunner
from shardline.wire.hops import no_hops, with_rows
from shardline.wire.link import Link, LinkClosed, Refused
from shardline.wire.messages import (
    RELAY,
    Forward,
    Refuse,
    Release,
    Sampled,
    StepFailed,
    mask_to_runs,
)
from shardline.wire.tls import Credentials

ACTIVATIONS = {"f16": np.float16, "f32": np.float32}
RECONNECT_S = 10.0  # how long a new stream waits for a chain that broke to come back


@dataclass
class _Sent:
    step: Step
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class _Release:
    key: int


class RemotePipeline:
    def __init__(self, folder: Path, workers: list[str], run: RunConfig | None = None,
                 activations: str = "f16", topology: str = "chain", credentials: Credentials | None = None) -> None:
        if activations not in ACTIVATIONS or topology not in ("chain", "star"):
            raise ShardlineError(f"bad activations {activations!r} or topology {topology!r}")
        self.folder = folder
        self.manifest = load_manifest(folder)
        entry = self.manifest.stages[0]
        verify(folder, self.manifest, only=[entry.xml, entry.bin])
        self.stage0 = StageRunner(folder, entry, run or RunConfig(), vocab=self.manifest.arch.vocab)
        self.n_stages = len(self.manifest.stages)
        self.dtype, self.activations = ACTIVATIONS[activations], activations
        self.topology = topology
        self.workers = workers
        self.credentials = credentials  # mutual TLS on every link (None: in clear, --insecure)
        self.links: list[Link] = []
        self.delivered: Delivered = []  # (worker, file, bytes) sent to workers
        self.outbox = Outbox()
        self._seq = count()
        self._pending: dict[int, _Sent] = {}  # by seq: steps sent and not yet answered
        # Why the chain stopped working (a link ended or a worker refused), until a reconnect.
        # Checked under the lock with _pending, so a step is either failed by the reader that
        # saw the chain break, or refused before it is sent: never sent into a dead chain.
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._local = 0  # steps submitted that stage 0 has not finished sending
        self._inbox: queue.Queue[Step | _Release | None] = queue.Queue()
        self.connect()
        self._thread = threading.Thread(target=self._stage0_loop, daemon=True, name="stage-0")
        self._thread.start()

    # --- the chain ---------------------------------------------------------------------------

    def connect(self) -> None:
        """(Re)open every worker link under a new session (chain.py) and read what comes back.
        Streams of an earlier session are gone on the workers (their next steps fail)."""
        for link in self.links:
            link.close()
        self.links = []
        self.links = open_chain(self.folder, self.manifest, self.workers, self.activations, self.topology,
                                self.delivered, self.credentials)
        self._broken = None
        if self.topology == "chain":  # tokens come back on the last link, refusals on any
            for link in self.links:
                threading.Thread(target=self._receive, args=(link,), daemon=True, name="receive").start()

    def _reconnect(self) -> None:
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                return self.connect()
            except ShardlineError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # --- executing plans -----------------------------------------------------------------------

    def submit(self, step: Step) -> None:
        with self._lock:
            self._local += 1
        self._inbox.put(step)

    def release(self, key: int) -> None:
        self._inbox.put(_Release(key))

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        """Whether stage 0 has run every submitted step (the rest is on workers and links)."""
        return self._local == 0

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)
        for link in self.links:
            link.close()

    def _stage0_loop(self) -> None:
        while (work := self._inbox.get()) is not None:
            if isinstance(work, _Release):
                self._release(work.key)
                continue
            try:
                self._send(work)
            except Exception as e:  # noqa: BLE001 - the step's rows fail; the next step goes on
                why = str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
                self._fail(work, why)
            finally:
                with self._lock:
                    self._local -= 1

    def _release(self, key: int) -> None:
        self.stage0.close(key)
        for link in self.links:
            with contextlib.suppress(LinkClosed):  # a dead worker holds nothing to free
                link.send(Release(key))

    def _send(self, step: Step) -> None:
        """Run stage 0 here and send the step down the chain; its tokens come back on a reader
        thread. A chain that broke is reconnected for a new stream's first step."""
        if self._broken and isinstance(step, PrefillStep) and step.first:
            self._reconnect()
        sent = _Sent(step)
        inputs = prepare(self.stage0, step)
        start = time.perf_counter()
        hidden = self.stage0.run(step.key, inputs)
        graph_s = time.perf_counter() - start
        fwd = self._forward(step, next(self._seq), hidden, graph_s, sent.started)
        with self._lock:
            if self._broken:
                raise ShardlineError(self._broken)
            self._pending[fwd.seq] = sent  # before the send: the token may be back at once
        if self.topology == "star":
            return self._through_star(fwd)
        try:
            self.links[0].send(fwd, stamp=True)
        except LinkClosed as e:
            with self._lock:
                self._pending.pop(fwd.seq, None)
            raise ShardlineError(f"worker {self.workers[0]}: {e}") from None

    def _forward(self, step: Step, seq: int, hidden: np.ndarray, graph_s: float, started: float) -> Forward:
        inputs = step.inputs
        keep, merge = (step.keep, step.merge) if isinstance(step, DecodeStep) else ((), ())
        hops = with_rows(no_hops(), [0], [graph_s], 0.0, time.perf_counter() - started - graph_s)
        compact = isinstance(step, DecodeStep) and step.compact
        d = step.drafted if isinstance(step, DecodeStep) else None
        return Forward(step.key, seq, step.phase, isinstance(step, PrefillStep) and step.first,
                       int(inputs.attention_mask.shape[1]), step.want_logits, compact, list(step.sampling),
                       np.asarray(step.streams, np.int64), np.asarray(keep, np.int64), np.asarray(merge, np.int64),
                       hidden.astype(self.dtype, copy=False), mask_to_runs(inputs.attention_mask),
                       inputs.position_ids, step.sample_at, None if d is None else d.tokens,
                       None if d is None else d.q_ids, None if d is None else d.q_probs, hops)

    def _fail(self, step: Step, why: str) -> None:
        for stream in step.streams:
            self.outbox.put(Outcome(stream, error=why))

    # --- what comes back -------------------------------------------------------------------------

    def _receive(self, link: Link) -> None:
        """Chain: tokens come back on the last worker's link, failed steps and refusals on any.
        A refusal or a lost link fails every step in flight (the chain is unusable)."""
        while True:
            try:
                msg = link.recv()
            except Exception as e:  # noqa: BLE001 - any end of the link ends this reader
                reason = f"lost worker {link.name}: {e}"
                break
            if isinstance(msg, Sampled):
                self._done(msg, link.last_decode_s, time.perf_counter())
            elif isinstance(msg, StepFailed):
                self._step_failed(msg.seq, f"worker {link.name}: {msg.reason}")
            else:
                reason = f"worker {link.name}: " + (msg.reason if isinstance(msg, Refuse) else
                                                     f"unexpected {type(msg).__name__}")
                break
        if link not in self.links:  # a reconnect replaced this link on purpose: nothing failed
            return
        with self._lock:
            self._broken = reason
            failed, self._pending = list(self._pending.values()), {}
        for sent in failed:
            self._fail(sent.step, reason)

    def _step_failed(self, seq: int, why: str) -> None:
        with self._lock:
            sent = self._pending.pop(seq, None)
        if sent is not None:
            self._fail(sent.step, why)

    def _done(self, msg: Sampled, decode_s: float, received_at: float) -> None:
        """Tokens are back (their frame decoded at `received_at`): an outcome per row, with the
        step's breakdown."""
        with self._lock:
            sent = self._pending.pop(msg.seq, None)
        if sent is None:
            return
        step = sent.step
        if msg.tokens.shape[0] != step.sample_at.shape[0]:
            return self._fail(step, f"{msg.tokens.shape[0]} tokens for {step.sample_at.shape[0]} positions")
        now = time.perf_counter()
        timing = breakdown(step.phase.value, msg.hops, decode_s, now - received_at, now - sent.started)
        rows = step.sample_at[:, 0].tolist()
        for r, stream in enumerate(step.streams):
            mine = tuple(_choice(msg, e, step.sampling[r].top_logprobs) for e, row in enumerate(rows) if row == r)
            self.outbox.put(Outcome(stream, mine, timing=timing))
        metrics.observe(timing)  # after the puts: the consumer need not wait for it

    def _through_star(self, fwd: Forward) -> None:
        """Star (for comparison): every worker's output comes back here and goes on to the next;
        each relay adds a coordinator row (stage RELAY) to the step's hops."""
        reply: Forward | Sampled = fwd
        received_at = time.perf_counter()
        try:
            for i, link in enumerate(self.links):
                if i:
                    assert isinstance(reply, Forward)
                    host_s = time.perf_counter() - received_at
                    rows = with_rows(reply.hops, [RELAY], [0.0], self.links[i - 1].last_decode_s, host_s)
                    # the merge was done by the worker before: the next one does its own
                    reply = replace(reply, hops=rows)
                link.send(reply, stamp=True)
                reply = self._expect(i, fwd.seq)
                received_at = time.perf_counter()
        except (ShardlineError, LinkClosed, Refused) as e:
            return self._step_failed(fwd.seq, str(e))
        if not isinstance(reply, Sampled):
            return self._step_failed(fwd.seq, f"worker {self.workers[-1]} returned hidden states, not tokens")
        self._done(reply, self.links[-1].last_decode_s, received_at)

    def _expect(self, i: int, seq: int) -> Forward | Sampled:
        reply = self.links[i].recv()
        if isinstance(reply, Refuse | StepFailed):
            raise ShardlineError(f"worker {self.workers[i]} refused: {reply.reason}")
        if not isinstance(reply, Forward | Sampled) or reply.seq != seq:
            raise ShardlineError(f"unexpected {type(reply).__name__} from worker {self.workers[i]}")
        return reply


def _choice(msg: Sampled, e: int, top_n: int) -> Choice:
    top: tuple[tuple[int, float], ...] = ()
    if top_n and msg.top_ids is not None and msg.top_logprobs is not None:
        ids, lps = msg.top_ids[e, :top_n].tolist(), msg.top_logprobs[e, :top_n].tolist()
        top = tuple((int(t), float(lp)) for t, lp in zip(ids, lps, strict=True) if t >= 0)
    logits = msg.logits[e] if msg.logits is not None else None
    return Choice(int(msg.tokens[e]), float(msg.logprobs[e]), top, logits)
