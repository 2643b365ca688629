"""The coordinator as a node: stage 0 here, later stages on workers.

Daisy chain (default): hidden states go worker to worker; only the last worker talks back, with
the chosen tokens and their log-probabilities. Star (for comparison, as the paper's measured
code): every worker returns its hidden states to the coordinator, which sends them to the next.

Stage 0 runs on a thread of its own that takes the submitted steps in order: it prepares and
runs each on stage 0 and sends it down the chain as a `Forward` (the mask as runs of ones).
Releases, KV exports and KV imports go through the same thread, so a key is freed, copied or
written on every stage after every step sent before (remote_kv.py). The coordinator's chain is
a session (a random id in its Hello): workers keep its streams apart from any other
coordinator's and free them all when its link drops.

A worker that lacks its shard asks for it during the handshake and the coordinator sends it
from its own export folder (node/delivery.py). Every token comes back with the durations each
hop measured; `Outcome.timing` breaks its round trip down (timing.py).

Faults: a worker that dies breaks its link at once; one that stops answering is caught by the
watchdog (watchdog.py) when the oldest step in flight overruns its deadline. Either way the
chain is broken (life.py: the chain's links, epochs, breaks and repairs): every step in flight
is lost (`Outcome.lost`), and so is every later step that needs state the chain held (held.py).
A stream's first step reopens the chain, within `reconnect_s`.

A paged export (issue 41) runs ragged steps instead (`Ragged` frames): stage 0's block pool is
here, and each worker allocates one of the same blocks for the session when it joins, so one
block table serves every stage. Nothing is held by key: a broken chain loses the blocks its
workers held, and a step that reads one of them is lost (held.py), its streams replayed. A
stream's KV moves by its blocks (disaggregated serving: remote_kv.py); a step that reads or
writes blocks still moving waits for the move to land on every worker.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from itertools import count
from pathlib import Path

import numpy as np

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.context import run_context
from shardline.model.manifest import load_manifest, verify
from shardline.pipeline import metrics
from shardline.pipeline.chain import Delivered, open_chain
from shardline.pipeline.deadline import Deadlines, StepClock
from shardline.pipeline.frames import choice, forward, ragged, unknown_tokens
from shardline.pipeline.heartbeat import beat, quiet_for, settle_for
from shardline.pipeline.held import needs, reads, writes
from shardline.pipeline.hidden import HiddenChunk, ragged_chunks
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.kv import StageLayout
from shardline.pipeline.life import ChainLife, Down, Lost, Sent
from shardline.pipeline.paged_local import is_paged, pool_blocks
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
from shardline.pipeline.remote_kv import KV_S, KvMoves, WireMove
from shardline.pipeline.star import StarRefused, relay
from shardline.pipeline.timing import breakdown
from shardline.pipeline.watchdog import Late, overdue, watch
from shardline.stage import executor as stage_work
from shardline.stage.paged_runner import PagedRunner
from shardline.stage.runners import Stage, open_stage
from shardline.wire.codec import WireError
from shardline.wire.link import Link, LinkClosed, Refused
from shardline.wire.messages import (
    LOST_NEXT,
    Forward,
    KvDone,
    KvPart,
    Pong,
    Ragged,
    Refuse,
    Sampled,
    StepFailed,
)
from shardline.wire.messages import Release as ReleaseMsg
from shardline.wire.tls import Credentials

log = logging.getLogger(__name__)
ACTIVATIONS = {"f16": np.float16, "f32": np.float32}
RECONNECT_S = 10.0  # how long a stream's first step waits for a chain that broke to come back
HEARTBEAT_S = 5.0  # a worker silent this long (pings unanswered) is taken as hung


class _Repair:
    """Stage 0's thread: reopen the chain if it is still broken (queued by the watchdog)."""


class RemotePipeline:
    def __init__(self, folder: Path, workers: list[str], run: RunConfig | None = None,
                 activations: str = "f16", topology: str = "chain", credentials: Credentials | None = None, *,
                 deadlines: Deadlines | None = None, reconnect_s: float = RECONNECT_S,
                 summarize: bool = False, heartbeat_s: float = HEARTBEAT_S, kv_bytes: int = 1 << 30,
                 streams: int | None = None) -> None:
        """`deadlines`: when a step in flight counts as lost (a worker hung); `reconnect_s`: how
        long a stream's first step tries to reopen a chain that broke (tests make both short);
        `heartbeat_s`: a worker silent this long, pings unanswered, is taken as hung (0: no pings);
        `summarize`: a prefill chunk's outcome carries stage 0's output summarized (hidden.py).
        A paged export's pools hold what `kv_bytes` holds over every stage (at most `streams`
        streams at the full context), as in one process (paged_local.py)."""
        if activations not in ACTIVATIONS or topology not in ("chain", "star"):
            raise ShardlineError(f"bad activations {activations!r} or topology {topology!r}")
        self.folder = folder
        self.manifest = load_manifest(folder)
        entry = self.manifest.stages[0]
        verify(folder, self.manifest, only=entry.files)
        run = run or RunConfig()
        self.context = run_context(self.manifest.arch, run.context)
        self.device = run.for_stage(0, 1).device
        self.n_stages = len(self.manifest.stages)
        self.stage0: Stage | None = None
        self.paged0: PagedRunner | None = None
        self.blocks = self.block_size = self.block_bytes = 0
        if is_paged(self.manifest):
            self.paged0 = PagedRunner.load(folder, entry, run.for_stage(0, 1), 1, vocab=self.manifest.arch.vocab,
                                           context=self.context)
            self.block_size = self.paged0.block_size
            # every stage's layers cost the same per block (paged layers all keep full blocks)
            per_block = self.paged0.block_bytes() * self.manifest.arch.n_layers // (entry.last_layer + 1)
            self.blocks = pool_blocks(per_block, self.block_size, self.context, kv_bytes, streams)
            self.block_bytes = per_block
            self.paged0.allocate(self.blocks)
        else:
            self.stage0 = open_stage(folder, entry, run.for_stage(0, 1), vocab=self.manifest.arch.vocab,
                                     context=self.context)
        if summarize and self.n_stages < 2:
            raise ShardlineError(f"{folder}: one stage outputs logits, not hidden states: summarizing prompts "
                                 f"needs an export of 2 or more stages")
        self.summarize = summarize
        self.dtype, self.activations = ACTIVATIONS[activations], activations
        self.topology = topology
        self.workers = workers
        self.credentials = credentials  # mutual TLS on every link (None: in clear, --insecure)
        self.delivered: Delivered = []  # (worker, file, bytes) sent to workers
        self.outbox = Outbox()
        self._seq = count()
        self._clock = StepClock(deadlines or Deadlines())  # when a step in flight counts as lost
        floor = self._clock.limits.floor_s
        self.kv = KvMoves(self.manifest, self.stage0, max(KV_S, floor), copy_s=floor, paged0=self.paged0)
        self.life = ChainLife(self._open, self._read, reconnect_s)
        self.life.held.block_size = self.block_size
        # Pings only where replies come back on every link (a star reads its links in turn).
        self.heartbeat_s = heartbeat_s if topology == "chain" else 0.0
        self._local = 0  # steps submitted that stage 0 has not finished sending (under life.lock)
        self._inbox: queue.Queue[Step | RaggedStep | Release | _Repair | WireMove | None] = queue.Queue()
        self._stopping = threading.Event()
        self.life.connect()
        self._thread = threading.Thread(target=self._stage0_loop, daemon=True, name="stage-0")
        self._thread.start()
        threading.Thread(target=watch, daemon=True, name="watchdog",
                         args=(self._stopping, self._clock, self._overdue, self._break, self._queue_repair)).start()
        if self.heartbeat_s:
            threading.Thread(target=beat, args=(self._stopping, self.life, self.heartbeat_s), daemon=True,
                             name="heartbeat").start()

    # --- the chain ---------------------------------------------------------------------------

    @property
    def links(self) -> list[Link]:
        return self.life.links

    def connect(self) -> None:
        """(Re)open every worker link under a new session (chain.py) and read what comes back."""
        self.life.connect()

    def _open(self) -> list[Link]:
        return open_chain(self.folder, self.manifest, self.workers, self.activations, self.topology,
                          self.delivered, self.credentials, self.context, self._reaching,
                          (self.block_size, self.blocks))

    def _reaching(self, i: int) -> None:
        self.life.reaching = i  # a plain store: read under the lock when an attempt fails

    def _read(self, links: list[Link], epoch: int) -> None:
        if self.topology == "chain":  # tokens come back on the last link, refusals on any
            for i, link in enumerate(links):
                threading.Thread(target=self._receive, args=(link, epoch, i), daemon=True, name="receive").start()

    def _repair(self) -> None:
        if self.life.repair():
            log.info("the chain is whole again: %s", ", ".join(self.workers))

    # --- executing plans -----------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        """Stage 0's pool here (each worker holds its own stages' for the session)."""
        return self.paged0.pool_bytes() if self.paged0 is not None else 0

    def submit(self, step: AnyStep) -> None:
        if isinstance(step, RaggedStep) != (self.paged0 is not None):
            raise ShardlineError("a paged export runs ragged steps only" if self.paged0 is not None else
                                 "ragged steps run on a paged export (shardline export --paged)")
        with self.life.lock:
            self._local += 1
        self._inbox.put(step)

    def release(self, key: int) -> None:
        if self.paged0 is None:  # a paged stage holds nothing by lease (the blocks are the scheduler's)
            self._inbox.put(Release(key))

    def move(self, item: KvMove) -> None:
        """As LocalPipeline's; a move also fails when the chain breaks under it."""
        self.outbox.watch(item)
        if not unfit(item, self.kv.identity, self.kv.layout, paged=self.paged0 is not None):
            self._inbox.put(item)

    def outcomes(self, timeout: float | None = None) -> list[Outcome | Moved]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def layout(self) -> list[StageLayout]:
        """Each stage's layers and state variables, as an import must fit them (remote_kv.py)."""
        return self.kv.layout()

    def placement(self) -> list[Placed]:
        """Stage 0 here, then each worker with the layers it answered its handshake with. While
        the chain is broken, the workers the break blames are down (a link of it ended, it
        refused, went silent, or a reconnect waited on it); a break that blames none marks all."""
        with self.life.lock:
            links, broken, blamed = list(self.life.links), self.life.broken, self.life.down
        e0 = self.manifest.stages[0]
        out = [Placed(e0.first_layer, e0.last_layer, "this process", device=self.device)]
        for i, addr in enumerate(self.workers):
            peer = links[i].peer if i < len(links) else None
            first, last = (peer.first_layer, peer.last_layer) if peer else (-1, -1)
            down = bool(broken) and (i in blamed or not blamed)
            out.append(Placed(first, last, addr, not down, (broken or "") if down else "", peer.device if peer else ""))
        return out

    def hurry_repair(self) -> None:
        """A request waits for the broken chain: try to reopen it now (life.hurry)."""
        self.life.hurry()

    def idle(self) -> bool:
        """Whether stage 0 has run every submitted step (the rest is on workers and links)."""
        return self._local == 0

    def shutdown(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        for link in self.life.links:
            link.close()
        self.kv.stopped(self._inbox)

    def _stage0_loop(self) -> None:
        while (work := self._inbox.get()) is not None:
            if isinstance(work, Release):
                self._release(work.lease)
                continue
            if isinstance(work, _Repair):
                self._repair()
                continue
            if isinstance(work, KvExport | KvImport | KvCopy):
                self._move_kv(work)
                continue
            try:
                self._send(work)
            except Lost as e:
                self._fail(work, str(e), lost=True)
            except Exception as e:  # noqa: BLE001 - the step's rows fail; the next step goes on
                why = str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
                self._fail(work, why)
            finally:
                with self.life.lock:
                    self._local -= 1

    def _release(self, key: int) -> None:
        assert self.stage0 is not None
        self.stage0.close(key)
        with self.life.lock:
            self.life.held.released(key)
            links = list(self.life.links)
        for link in links:
            with contextlib.suppress(LinkClosed):  # a dead worker holds nothing to free
                link.send(ReleaseMsg(key))

    def _move_kv(self, work: WireMove) -> None:
        """Stage 0's part of a KV move here, the workers' over their links (remote_kv.py). An
        import may reopen a broken chain, as a stream's first step does."""
        life = self.life
        try:
            if life.broken and isinstance(work, KvImport):
                life.reconnect(work.made)
            move = self.kv.begin(work, next(self._seq), len(self.workers))
        except ShardlineError as e:
            return self.kv.refused(work, str(e))
        with life.lock:
            broken, links, epoch = life.broken, list(life.links), life.epoch
            if not broken:
                self.kv.track(move, links, self.workers)
                if isinstance(work, KvImport | KvCopy):
                    life.held.imported(work)
        if broken:
            return self.kv.end(move, f"the chain broke: {broken}")
        try:
            self.kv.run(move, star=self.topology == "star")
        except (ShardlineError, LinkClosed, Refused, WireError) as e:
            self._break(f"lost worker: {e}", epoch)  # ends the move with the reason

    def _send(self, step: Step | RaggedStep) -> None:
        """Run stage 0 here and send the step down the chain; its tokens come back on a reader
        thread. A chain that broke is reconnected for a stream's first step; any other step
        whose state the chain no longer holds is lost before stage 0 runs it."""
        if isinstance(step, RaggedStep):
            return self._send_ragged(step)
        assert self.stage0 is not None
        life = self.life
        if life.broken and isinstance(step, PrefillStep) and step.first:
            life.reconnect(step.made)
        with life.lock:
            if missing := life.held.missing(step):
                raise Lost(f"the state of key {missing[0]} went with a chain that broke: "
                           f"{life.broken or life.last_break}")
        self.kv.settle(needs(step))
        sent = Sent(step)
        took: list[float] = []
        hidden = stage_work.run([self.stage0], step.work(), None, took)
        graph_s = took[0]
        sent.expected_s = graph_s * (self.n_stages - 1)
        if self.summarize and isinstance(step, PrefillStep):
            sent.hidden = {step.streams[0]: HiddenChunk.of(hidden)}
        self._out(sent, forward(step, next(self._seq), hidden.astype(self.dtype, copy=False), graph_s, sent.started))

    def _send_ragged(self, step: RaggedStep) -> None:
        """A paged step: any may reopen a broken chain, but one that reads blocks the chain
        before held is lost (its workers' pools start empty): its streams are replayed."""
        assert self.paged0 is not None
        life = self.life
        if life.broken:
            life.reconnect(step.made)
        with life.lock:
            if (block := life.held.unwritten(step)) is not None:
                raise Lost(f"KV block {block} went with a chain that broke: {life.broken or life.last_break}")
        if self.kv.busy():  # a block moving on a later worker's own link: this step must not overtake it
            self.kv.settle(reads(step, self.block_size) | writes(step, self.block_size))
        sent = Sent(step)
        began = time.perf_counter()
        hidden = self.paged0.run(step.batch, step.ids)
        graph_s = time.perf_counter() - began
        if self.summarize:
            sent.hidden = ragged_chunks(step.streams, step.prompts, step.batch.begins, hidden)
        sent.expected_s = graph_s * (self.n_stages - 1)
        self._out(sent, ragged(step, next(self._seq), hidden.astype(self.dtype), graph_s, sent.started))

    def _out(self, sent: Sent, fwd: Forward | Ragged) -> None:
        """`fwd` down the chain, pending until its tokens come back."""
        life = self.life
        with life.lock:
            if life.broken:  # since the check before stage 0 ran (only this thread reconnects)
                raise Lost(life.broken)
            sent.out_at = time.monotonic()
            life.pending[fwd.seq] = sent  # before the send: the token may be back at once
            life.held.sent(sent.step)
            epoch, first = life.epoch, life.links[0]
        if self.topology == "star":
            return self._through_star(fwd, epoch)
        try:
            first.send(fwd, stamp=True)
        except LinkClosed as e:  # the step is pending: breaking the chain loses it with the rest
            self._break(f"lost worker {self.workers[0]}: {e}", epoch, frozenset({0}))

    def _fail(self, step: Step | RaggedStep, why: str, lost: bool = False) -> None:
        for stream in step.streams:
            self.outbox.put(Outcome(stream, error=why, lost=lost))

    def _break(self, reason: str, epoch: int, down: Down = frozenset()) -> None:
        """The chain of `epoch` is unusable (life.py), because of the workers `down` (empty:
        it cannot tell): every step in flight and every KV move is lost. Once broken, later
        news of the same chain changes nothing."""
        lost = self.life.break_(reason, epoch, down)
        if lost is None:
            return
        for sent in lost:
            self._fail(sent.step, reason, lost=True)
        self.kv.fail_all(reason)

    def _overdue(self) -> Late | None:
        return overdue(self.life, self._clock, self.workers, self.kv.overdue, quiet_for(self.heartbeat_s),
                       settle_for(self.heartbeat_s))

    def _queue_repair(self) -> None:
        """A repair for stage 0's thread once one is due and the pipeline is idle (a request's
        own first step reconnects otherwise, as it always has)."""
        with self.life.lock:
            busy = bool(self._local) or not self._inbox.empty()
        if self.life.repair_due(busy):
            self._inbox.put(_Repair())

    # --- what comes back -------------------------------------------------------------------------

    def _through_star(self, fwd: Forward | Ragged, epoch: int) -> None:
        """Star: on this thread, worker after worker. A worker refusing the step fails it; a
        link that ends or stalls breaks the chain."""
        try:
            reply, received_at = relay(self.life.links, self.workers, fwd)
        except StarRefused as e:
            return self._step_failed(fwd.seq, str(e))
        except (ShardlineError, LinkClosed, Refused, WireError) as e:
            return self._break(f"lost worker: {e}", epoch)
        self._done(reply, self.life.links[-1].last_decode_s, received_at)

    def _receive(self, link: Link, epoch: int, me: int) -> None:
        """Chain: tokens come back on the last worker's link, failed steps and refusals on any.
        A refusal or a lost link breaks the chain (every step in flight is lost), blaming this
        link's worker, or the next one when this one says it lost it."""
        down = frozenset({me})
        while True:
            try:
                msg = link.recv()
            except Exception as e:  # noqa: BLE001 - any end of the link ends this reader
                reason = f"lost worker {link.name}: {e}"
                break
            if isinstance(msg, Pong):  # its bytes were the news (link.heard)
                continue
            if isinstance(msg, Sampled):
                self._done(msg, link.last_decode_s, time.perf_counter())
            elif isinstance(msg, StepFailed):
                self._step_failed(msg.seq, f"worker {link.name}: {msg.reason}")
            elif isinstance(msg, KvPart | KvDone):
                self.kv.received(link, msg)
            else:
                reason = f"worker {link.name}: " + (msg.reason if isinstance(msg, Refuse) else
                                                     f"unexpected {type(msg).__name__}")
                if isinstance(msg, Refuse) and LOST_NEXT in msg.reason and me + 1 < len(self.workers):
                    down = frozenset({me + 1})
                break
        self._break(reason, epoch, down)  # nothing, if a reconnect replaced this link on purpose

    def _answered(self, seq: int, timed: bool) -> Sent | None:
        """The step `seq` was answered now (None: it was not in flight, e.g. lost meanwhile)."""
        with self.life.lock:
            sent = self.life.pending.pop(seq, None)
            if sent is not None:
                self._clock.answered(sent.step.phase, sent.out_at, time.monotonic(), timed)
        return sent

    def _step_failed(self, seq: int, why: str) -> None:
        """A worker refused the step itself (it does not fit): its streams fail, not lost."""
        if (sent := self._answered(seq, timed=False)) is not None:
            self._fail(sent.step, why)

    def _done(self, msg: Sampled, decode_s: float, received_at: float) -> None:
        """Tokens are back (their frame decoded at `received_at`): an outcome per row, with the
        step's breakdown."""
        if (sent := self._answered(msg.seq, timed=True)) is None:
            return
        step = sent.step
        if msg.tokens.shape[0] != step.sample_at.shape[0]:
            return self._fail(step, f"{msg.tokens.shape[0]} tokens for {step.sample_at.shape[0]} positions")
        if (why := unknown_tokens(msg, self.manifest.arch.vocab)) is not None:
            return self._fail(step, why)
        now = time.perf_counter()
        timing = breakdown(step.phase.value, msg.hops, decode_s, now - received_at, now - sent.started)
        rows = step.sample_at[:, 0].tolist()
        for r, stream in enumerate(step.streams):
            mine = tuple(choice(msg, e, step.sampling[r].top_logprobs) for e, row in enumerate(rows) if row == r)
            self.outbox.put(Outcome(stream, mine, timing=timing, hidden=sent.hidden.get(stream)))
        metrics.observe(timing, len(step.streams))  # after the puts: the consumer need not wait for it
