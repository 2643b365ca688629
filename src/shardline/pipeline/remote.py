"""The coordinator as a node: tokenizer-side loop and stage 0 here, later stages on workers.

Daisy chain (default): hidden states go worker to worker; only the last worker talks back, with
the sampled token and its log-probability. Star (for comparison, as the paper's measured code):
every worker returns its hidden states to the coordinator, which sends them to the next.

A worker that lacks its shard asks for it during the handshake and the coordinator sends it
from its own export folder (delivery.py). Every token comes back with the durations each hop
measured; `Outcome.timing` breaks its round trip down (timing.py) and metrics.py exports it.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import replace
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.sampler import Choice
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest, verify
from shardline.node import delivery
from shardline.pipeline import metrics
from shardline.pipeline.groups import MAX_ROWS, Group, Groups, Launch, apply_merge, batch_inputs
from shardline.pipeline.inflight import Outbox, Outcome
from shardline.pipeline.timing import breakdown, no_hops, with_rows
from shardline.stage.cache import Decode, KVBook, Prefill, Step, StepInputs
from shardline.stage.runner import StageRunner
from shardline.wire.link import Link, LinkClosed, Refused, client_handshake, refuse
from shardline.wire.messages import (
    PROTOCOL,
    RELAY,
    CloseStream,
    Forward,
    Hello,
    Message,
    OpenStream,
    Refuse,
    Route,
    Sampled,
    ShardRequest,
)

ACTIVATIONS = {"f16": np.float16, "f32": np.float32}


class RemotePipeline:
    def __init__(self, folder: Path, workers: list[str], run: RunConfig | None = None,
                 activations: str = "f16", topology: str = "chain", groups: int = 0,
                 group_rows: int = MAX_ROWS) -> None:
        if activations not in ACTIVATIONS or topology not in ("chain", "star"):
            raise ShardlineError(f"bad activations {activations!r} or topology {topology!r}")
        self.folder = folder
        self.manifest = load_manifest(folder)
        entry = self.manifest.stages[0]
        verify(folder, self.manifest, only=[entry.xml, entry.bin])
        self.stage0 = StageRunner(folder, entry, run or RunConfig())
        self.dtype = ACTIVATIONS[activations]
        self.topology = topology
        self.workers = workers
        self.links: list[Link] = []
        self._books: dict[int, KVBook] = {}
        self._sampling: dict[int, dict[str, Any]] = {}  # per stream, as it travels in Forward
        self._want_logits: set[int] = set()  # streams opened with SamplingConfig.logprobs > 0
        self._started: dict[int, tuple[float, str]] = {}  # stream -> (submit() called, phase)
        self.delivered: list[tuple[str, str, int]] = []  # (worker, file, bytes) sent to workers
        # Stream ids are global on a worker (its caches are keyed by them, whichever link a step
        # arrives on), so each coordinator starts at a random 48-bit offset.
        self._ids = count(secrets.randbits(48) << 8)
        self._seq = count()
        self.outbox = Outbox()
        self._inflight: set[int] = set()  # streams with a step between submit and outcome
        # Why the chain stopped working (a link ended or a worker refused), until a reconnect.
        # Checked under the lock with _inflight, so a step is either failed by the reader that
        # saw the chain break, or refused at submit: never sent into a dead chain and forgotten.
        self._broken: str | None = None
        self._lock = threading.Lock()
        self.groups = Groups(groups, group_rows)
        self.connect()

    def connect(self) -> None:
        """(Re)open every worker link, check the chain, and tell each worker where to send."""
        for link in self.links:
            link.close()
        self.links = []
        last = self.manifest.stages[0].last_layer
        for addr in self.workers:
            link, hello = self._connect_one(addr, last)
            self.links.append(link)
            last = hello.last_layer
        if last != self.manifest.arch.n_layers - 1:
            raise ShardlineError(f"the workers end at layer {last}; the model has {self.manifest.arch.n_layers} layers")
        for i, link in enumerate(self.links):
            chained = self.topology == "chain" and i + 1 < len(self.links)
            link.send(Route(self.workers[i + 1] if chained else ""))
        self._broken = None
        if self.topology == "chain":  # tokens come back on the last link, refusals on any
            for link in self.links:
                threading.Thread(target=self._receive, args=(link,), daemon=True, name="receive").start()
        # Streams opened before a reconnect have lost their worker-side caches: their next step
        # is refused by the worker ("unknown stream") and fails; new streams are unaffected.

    def _connect_one(self, addr: str, prev_last: int) -> tuple[Link, Hello]:
        host, _, port = addr.rpartition(":")
        try:
            link = Link.connect(host, int(port))
        except (OSError, ValueError) as e:
            raise ShardlineError(f"cannot reach worker {addr}: {e}") from None
        m = self.manifest
        # On each link the coordinator speaks for the chain up to the layer before that worker.
        mine = Hello(PROTOCOL, "coordinator", m.model_hash, 0, prev_last, m.weights, str(np.dtype(self.dtype)))

        def check(peer: Hello) -> str | None:
            if peer.model_hash != m.model_hash:
                return (f"model hash mismatch: coordinator has {m.model_hash[:12]}, "
                        f"worker {addr} has {peer.model_hash[:12]}")
            if peer.first_layer != prev_last + 1:
                return (f"worker {addr} serves layers {peer.first_layer}-{peer.last_layer}, "
                        f"but the chain needs layer {prev_last + 1} next")
            if peer.weights != m.weights:
                return f"precision mismatch: coordinator has {m.weights} weights, worker {addr} has {peer.weights}"
            return None

        try:
            return link, client_handshake(link, mine, check, lambda msg: self._deliver(addr, link, msg))
        except (Refused, LinkClosed) as e:
            link.close()
            raise ShardlineError(f"worker {addr}: {e}") from None

    def _deliver(self, addr: str, link: Link, msg: Message) -> None:
        """A worker without its shard asks for a file before its Hello: send it, or refuse."""
        try:
            sent = delivery.serve(link, self.folder, self.manifest, msg)
        except delivery.DeliveryError as e:
            raise refuse(link, str(e)) from None
        assert isinstance(msg, ShardRequest)
        self.delivered.append((addr, msg.name, sent))

    # --- streams ---------------------------------------------------------------------------

    def open(self, sampling: SamplingConfig | None = None) -> int:
        """A new stream. A worker that went away since the last request (say, restarted) is
        reconnected here, so a coordinator outlives its workers."""
        if self._broken or not all(link.alive() for link in self.links):
            self._reconnect()
        stream = next(self._ids)
        self.stage0.open(stream)
        for link in self.links:
            link.send(OpenStream(stream))
        self._books[stream] = KVBook()
        s = sampling or SamplingConfig()
        self._sampling[stream] = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}
        if s.logprobs or s.want_logits:
            self._want_logits.add(stream)
        return stream

    def _reconnect(self, attempts: int = 50, wait_s: float = 0.2) -> None:
        for attempt in range(attempts):
            try:
                self.connect()
                return
            except ShardlineError:
                if attempt == attempts - 1:
                    raise
                time.sleep(wait_s)

    def close(self, stream: int) -> None:
        self.stage0.close(stream)
        for link in self.links:
            with contextlib.suppress(LinkClosed):  # a dead worker holds no cache to free
                link.send(CloseStream(stream))
        self._books.pop(stream, None)
        self._sampling.pop(stream, None)
        self._want_logits.discard(stream)
        launch, emptied = self.groups.leave(stream)
        if launch is not None:
            self._launch(launch)
        if emptied is not None:  # nobody left: free the departed rows' KV now
            self.close(emptied)

    def advance(self, stream: int, step: Step) -> Choice:
        self.submit(stream, step)
        got = self.outbox.wait_for(stream)
        self._inflight.discard(stream)
        if got.choice is None:
            raise ShardlineError(got.error)
        return got.choice

    def submit(self, stream: int, step: Step) -> None:
        """Run stage 0 here and send the step down the chain; its token comes out of `outcomes`.
        Stage 0 is then free for another stream while the workers run this one. With decode
        groups, a decode step waits for the rest of its group (see groups.py)."""
        if self.groups and isinstance(step, Decode):
            if (group := self.groups.ready(stream, step.token)) is not None:
                self._launch(group)
            return
        started = time.perf_counter()
        book = self._books[stream]
        inputs = book.plan(step)
        book.commit(inputs)  # the stream's next step is planned only after this one's outcome
        self._send(Launch(stream, [stream], [], [0], []), inputs, "prefill" if isinstance(step, Prefill) else "decode",
                   started)

    def _launch(self, group: Group) -> None:
        """One decode step of every member of `group`: merged here on stage 0, and by each
        worker from the same plan (Forward.keep / merge)."""
        started = time.perf_counter()
        plan = group.launch()
        apply_merge(self.stage0, plan)
        self._send(plan, batch_inputs(self._books, plan), "decode", started)

    def _send(self, plan: Launch, inputs: StepInputs, phase: str, started: float) -> None:
        graph_start = time.perf_counter()
        hidden = self.stage0.run(plan.key, inputs)
        graph_s = time.perf_counter() - graph_start
        with self._lock:
            if self._broken:
                raise ShardlineError(self._broken)
            self._inflight.update(plan.rows)
        self._started[plan.key] = (started, phase)  # before the send: the token may be back at once
        # The mask travels as u8 (it holds 0/1): 1 byte per context slot per hop instead of 8.
        fwd = Forward(plan.key, next(self._seq), phase, plan.rows, plan.keep, plan.joiners,
                      hidden.astype(self.dtype, copy=False), inputs.attention_mask.astype(np.uint8),
                      inputs.position_ids, [self._sampling[s] for s in plan.rows],
                      any(s in self._want_logits for s in plan.rows),
                      with_rows(no_hops(), [0], [graph_s], 0.0, time.perf_counter() - started - graph_s))
        if self.topology == "chain":
            try:
                self.links[0].send(fwd, stamp=True)
            except LinkClosed as e:
                self._inflight.difference_update(plan.rows)
                self._started.pop(plan.key, None)
                raise ShardlineError(f"worker {self.workers[0]}: {e}") from None
        else:
            for failed in self._through_star(fwd):
                self.outbox.put(failed)

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        got = self.outbox.take(timeout)
        self._inflight.difference_update(o.stream for o in got)
        return got

    def _receive(self, link: Link) -> None:
        """Chain: tokens come back on the last worker's link. A refusal or a lost link fails the
        steps in flight (the workers' caches for them are gone or unusable)."""
        while True:
            try:
                msg = link.recv()
            except Exception as e:  # noqa: BLE001 - any end of the link ends this reader
                reason = f"lost worker {link.name}: {e}"
                break
            if isinstance(msg, Sampled):
                self._done(msg, link.last_decode_s, time.perf_counter())
            else:
                reason = f"worker {link.name}: " + (msg.reason if isinstance(msg, Refuse) else
                                                     f"unexpected {type(msg).__name__}")
                break
        if link not in self.links:  # a reconnect replaced this link on purpose: nothing failed
            return
        with self._lock:
            self._broken = reason
            failed = list(self._inflight)
        self._started.clear()
        for stream in failed:
            self.outbox.put(Outcome(stream, None, reason))

    def _done(self, msg: Sampled, decode_s: float, received_at: float) -> None:
        """Tokens are back (their frame decoded at `received_at`): an outcome per row, with the
        step's breakdown."""
        started, phase = self._started.pop(msg.stream, (received_at, "decode"))
        now = time.perf_counter()
        timing = breakdown(phase, msg.hops, decode_s, now - received_at, now - started)
        for r, stream in enumerate(msg.rows):
            logits = msg.logits[r] if msg.logits is not None and stream in self._want_logits else None
            self.outbox.put(Outcome(stream, Choice(msg.tokens[r], msg.logprobs[r], logits), timing=timing))
        metrics.observe(timing)  # after the puts: the consumer need not wait for it

    def _through_star(self, fwd: Forward) -> list[Outcome]:
        """Star (for comparison): every worker's output comes back here and goes on to the next;
        each relay adds a coordinator row (stage RELAY) to the step's hops. Returns the outcomes
        to post when the step failed (none when its tokens were posted)."""
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
        except (ShardlineError, LinkClosed) as e:
            self._started.pop(fwd.stream, None)
            return [Outcome(s, None, str(e)) for s in fwd.rows]
        if not isinstance(reply, Sampled):
            self._started.pop(fwd.stream, None)
            why = f"worker {self.workers[-1]} returned hidden states, not a token"
            return [Outcome(s, None, why) for s in fwd.rows]
        self._done(reply, self.links[-1].last_decode_s, received_at)
        return []

    def _expect(self, i: int, seq: int) -> Forward | Sampled:
        reply = self.links[i].recv()
        if isinstance(reply, Refuse):
            raise ShardlineError(f"worker {self.workers[i]} refused: {reply.reason}")
        if not isinstance(reply, Forward | Sampled) or reply.seq != seq:
            raise ShardlineError(f"unexpected {type(reply).__name__} from worker {self.workers[i]}")
        return reply

    def shutdown(self) -> None:
        for link in self.links:
            link.close()
