"""A stage worker: hosts a contiguous run of stages and serves the chain.

Threads: one acceptor, one reader per connection (it only decodes frames and queues them), and
one executor that runs every message in arrival order, so a stream's steps never race and a
bad connection never stalls the others. Output goes to the next worker (daisy chain) or back
on the coordinator's link (end of chain, or star).

A worker may start without its shard (`fetch=True`, as `shardline worker` does, or
`StageWorker.empty`): it listens at once, and the first coordinator that connects delivers
whatever the folder lacks during the handshake (delivery.py); the stages load then and the
files stay cached for the next start. A process that only knows a folder and a stage range (a
Ray actor, say) starts a worker this way.

Every step leaves its durations in the message's `hops` (timing.py): per stage graph time, and
for the process its decode, host and (stamped by the codec) encode time.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.sampler import Choice, Sampler
from shardline.errors import ShardlineError
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.node.delivery import DeliveryError, fetch, stage_files
from shardline.pipeline.groups import Launch, apply_merge
from shardline.pipeline.timing import with_rows
from shardline.stage.cache import StepInputs
from shardline.stage.runner import StageRunner
from shardline.wire.codec import WireError
from shardline.wire.link import Link, LinkClosed, Refused, client_handshake, refuse, server_handshake
from shardline.wire.messages import (
    PROTOCOL,
    CloseStream,
    Forward,
    Hello,
    Message,
    OpenStream,
    Refuse,
    Route,
    Sampled,
)

log = logging.getLogger("shardline.worker")
_NO_IDS = np.zeros((1, 0), dtype=np.int64)
# What the reader thread queues: the link, the message, its decode time, and when it was decoded.
_Received = tuple[Link, Message, float, float]


def parse_stage_range(spec: str, n_stages: int | None) -> tuple[int, int]:
    """K or K-L; checked against the export's stage count when known (a worker that waits for its
    shard learns it from the delivered manifest, and refuses a range the model does not have)."""
    lo, _, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ShardlineError(f"bad --stage {spec!r} (expected K or K-L)") from None
    if not 1 <= first <= last < (n_stages if n_stages is not None else last + 1):
        bound = f"1-{n_stages - 1}" if n_stages is not None else "1 and up"
        raise ShardlineError(f"--stage {spec!r}: workers host stages {bound} (stage 0 is the coordinator's)")
    return first, last


def stage_count(folder: Path) -> int | None:
    """Stages of the export in `folder`, or None when it has no readable manifest (yet)."""
    try:
        return len(load_manifest(folder).stages)
    except ShardlineError:
        return None


class StageWorker:
    def __init__(self, folder: Path, first: int, last: int, run: RunConfig | None = None, *,
                 fetch: bool = False) -> None:
        """Serve stages first-last of the export in `folder`. Without `fetch` the folder must hold
        them, verified now (else ShardlineError); with `fetch` whatever is missing or corrupt is
        received from the first coordinator that connects (the folder may be empty or absent)."""
        self.folder, self.first, self.last = folder, first, last
        self.run = run or RunConfig()
        self.stages: list[StageRunner] = []
        self.is_last = False
        self.hello: Hello | None = None  # set once the stages are loaded: the worker is ready
        self.received_bytes = 0  # shard bytes delivered by a coordinator since this start
        self._loading = threading.Lock()
        self._inbox: queue.Queue[_Received] = queue.Queue()
        self._samplers: dict[int, Sampler] = {}
        self._next: Link | None = None  # downstream worker, when in a daisy chain
        self._reply: Link | None = None  # the coordinator's link
        self._server: socket.socket | None = None
        self.port = 0
        if (manifest := self._cached(fetch)) is not None:
            self._load(manifest)

    @classmethod
    def empty(cls, folder: Path, first: int, last: int, run: RunConfig | None = None) -> StageWorker:
        """A worker that takes its shard from the first coordinator unless `folder` holds it."""
        return cls(folder, first, last, run, fetch=True)

    def _cached(self, fetch: bool) -> Manifest | None:
        """The manifest when the folder holds this worker's stages, verified; else None (fetch)."""
        try:
            manifest = load_manifest(self.folder)
            verify(self.folder, manifest, only=stage_files(manifest, self.first, self.last))
            return manifest
        except (ShardlineError, DeliveryError) as e:
            if not fetch:
                raise ShardlineError(str(e)) from None
            log.info("%s; waiting for a coordinator to deliver stages %d-%d", e, self.first, self.last)
            return None

    def _load(self, manifest: Manifest) -> None:
        entries = manifest.stages[self.first : self.last + 1]
        self.stages = [StageRunner(self.folder, e, self.run) for e in entries]
        self.is_last = entries[-1].has_head
        self.hello = Hello(PROTOCOL, "worker", manifest.model_hash, entries[0].first_layer,
                           entries[-1].last_layer, manifest.weights, "any")

    def _ready_for(self, link: Link, peer: Hello) -> Hello:
        """This worker's Hello for `peer`, fetching and loading the shard first if need be."""
        with self._loading:  # one delivery at a time; later connections find the stages loaded
            if self.hello is None:
                if peer.role != "coordinator":
                    raise refuse(link, f"the worker for stages {self.first}-{self.last} has no shard yet: "
                                       f"only a coordinator can deliver it")
                manifest, self.received_bytes = fetch(link, self.folder, peer, self.first, self.last)
                try:
                    self._load(manifest)
                except ShardlineError as e:
                    raise refuse(link, str(e)) from None
                log.info("stages %d-%d loaded from %s (%d bytes delivered)", self.first, self.last,
                         self.folder, self.received_bytes)
            assert self.hello is not None
            return self.hello

    # --- connections ---------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        self._server = socket.create_server((host, port))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="accept").start()
        return self.port

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                sock, addr = self._server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = Link(sock, f"{addr[0]}:{addr[1]}")
            threading.Thread(target=self._read, args=(link,), daemon=True).start()

    def _check_peer(self, peer: Hello) -> str | None:
        me = self.hello
        assert me is not None  # checked after _ready_for
        if peer.model_hash != me.model_hash:
            return (f"model hash mismatch: worker (layers {me.first_layer}-{me.last_layer}) has "
                    f"{me.model_hash[:12]}, {peer.role} has {peer.model_hash[:12]}")
        if peer.weights != me.weights:
            return f"precision mismatch: worker has {me.weights} weights, {peer.role} has {peer.weights}"
        if peer.last_layer + 1 != me.first_layer:
            return (f"layer order: the {peer.role}'s chain ends at layer {peer.last_layer}, "
                    f"but this worker serves layers {me.first_layer}-{me.last_layer}")
        return None

    def _read(self, link: Link) -> None:
        """Per connection: handshake, then queue every message; a bad peer loses only its link."""
        try:
            server_handshake(link, lambda peer: self._ready_for(link, peer), self._check_peer)
            while True:
                msg = link.recv()
                self._inbox.put((link, msg, link.last_decode_s, time.perf_counter()))
        except (WireError, Refused) as e:
            log.warning("dropping %s: %s", link.name, e)
        except LinkClosed:
            pass
        link.close()

    # --- execution -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while True:
            link, msg, decode_s, decoded_at = self._inbox.get()
            try:
                self.handle(link, msg, decode_s, decoded_at)
            except (LinkClosed, WireError, Refused) as e:
                log.warning("while handling %s from %s: %s", type(msg).__name__, link.name, e)

    def handle(self, link: Link, msg: Message, decode_s: float = 0.0, decoded_at: float | None = None) -> None:
        if isinstance(msg, OpenStream):
            for s in self.stages:
                if not s.has(msg.stream):  # its first prefill may have opened it already
                    s.open(msg.stream)
        elif isinstance(msg, CloseStream):
            for s in self.stages:
                s.close(msg.stream)
            self._samplers.pop(msg.stream, None)
        elif isinstance(msg, Route):
            self._route(link, msg)
        elif isinstance(msg, Forward):
            self._forward(msg, decode_s, time.perf_counter() if decoded_at is None else decoded_at)
        elif isinstance(msg, Refuse):
            log.warning("%s refused this worker: %s", link.name, msg.reason)
            link.close()
        else:
            link.send(Refuse(f"a worker does not take {type(msg).__name__}"))

    def _route(self, link: Link, msg: Route) -> None:
        self._reply = link
        if self._next is not None:
            self._next.close()
            self._next = None
        if msg.next:
            host, _, port = msg.next.rpartition(":")
            nxt = Link.connect(host, int(port))
            me = self.hello
            assert me is not None  # a Route comes only after this worker's Hello
            client_handshake(nxt, me, lambda peer: None if peer.first_layer == me.last_layer + 1 else
                             f"next worker starts at layer {peer.first_layer}, expected {me.last_layer + 1}")
            self._next = nxt

    def _forward(self, msg: Forward, decode_s: float, decoded_at: float) -> None:
        assert self.hello is not None
        plan = Launch(msg.stream, msg.rows, [], msg.keep, msg.merge)
        for s in self.stages:  # a decode group's joiners become rows (the coordinator's plan)
            apply_merge(s, plan)
        if not self.stages[0].has(msg.stream):
            # A stream's first prefill may overtake its OpenStream (they come on different links
            # in a chain): a step that starts from an empty cache opens the stream itself.
            if msg.attention_mask.shape[1] != msg.position_ids.shape[1]:
                self._send_back(Refuse(f"unknown stream {msg.stream} on the worker for layers "
                                       f"{self.hello.first_layer}-{self.hello.last_layer} (restarted?)"))
                return
            for s in self.stages:
                s.open(msg.stream)
        mask = msg.attention_mask.astype(np.int64)  # travels as u8
        inputs = StepInputs(_NO_IDS, mask, msg.position_ids, plan.beam_idx)
        out = msg.hidden.astype(np.float32, copy=False)
        graph_s = []
        for s in self.stages:
            start = time.perf_counter()
            out = s.run(msg.stream, inputs, out)
            graph_s.append(time.perf_counter() - start)
        if self.is_last:
            choices = [self._choose(stream, cfg, out[r, -1]) for r, (stream, cfg)
                       in enumerate(zip(msg.rows, msg.sampling, strict=True))]
            logits = out[:, -1].astype(np.float32) if msg.want_logits else None
            self._send_back(Sampled(msg.stream, msg.seq, msg.rows, [c.token for c in choices],
                                    [c.logprob for c in choices], logits,
                                    self._hops(msg, graph_s, decode_s, decoded_at)), stamp=True)
            return
        hidden = out.astype(msg.hidden.dtype, copy=False)  # activations keep the link's dtype
        # The merge is done here: the next worker does its own from the same plan.
        fwd = replace(msg, hidden=hidden, hops=self._hops(msg, graph_s, decode_s, decoded_at))
        if self._next is None:  # a star: hidden states go back to the coordinator
            self._send_back(fwd, stamp=True)
            return
        try:
            self._next.send(fwd, stamp=True)
        except LinkClosed as e:  # tell the coordinator now, rather than leave its step hanging
            self._next = None
            self._send_back(Refuse(f"the worker for layers {self.hello.first_layer}-{self.hello.last_layer} "
                                   f"lost the next worker: {e}"))

    def _hops(self, msg: Forward, graph_s: list[float], decode_s: float, decoded_at: float) -> np.ndarray:
        """The incoming rows plus this worker's; taken last before encoding, so host time covers
        everything since the frame was decoded (queueing, casts, sampling) but graph and encode."""
        host_s = time.perf_counter() - decoded_at - sum(graph_s)
        return with_rows(msg.hops, [s.entry.index for s in self.stages], graph_s, decode_s, host_s)

    def _choose(self, stream: int, sampling: dict[str, Any], row: np.ndarray) -> Choice:
        sampler = self._samplers.get(stream)
        if sampler is None:
            sampler = self._samplers[stream] = Sampler(SamplingConfig(**sampling))
        return sampler.choose(row)

    def _send_back(self, msg: Message, stamp: bool = False) -> None:
        if self._reply is None:
            raise LinkClosed("no route to the coordinator yet")
        self._reply.send(msg, stamp)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
