"""A stage worker: hosts a contiguous run of stages and serves the chain.

Threads: one acceptor, one reader per connection (it only decodes frames and queues them), and
one executor that runs every message in arrival order, so a stream's steps never race and a
bad connection never stalls the others. Output goes to the next worker (daisy chain) or back
on the coordinator's link (end of chain, or star).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from pathlib import Path

import numpy as np

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.sampler import Sampler
from shardline.errors import ShardlineError
from shardline.export.manifest import load_manifest, verify
from shardline.stage.cache import StepInputs
from shardline.stage.runner import StageRunner
from shardline.wire.codec import WireError
from shardline.wire.link import Link, LinkClosed, Refused, client_handshake, server_handshake
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


def parse_stage_range(spec: str, n_stages: int) -> tuple[int, int]:
    lo, _, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ShardlineError(f"bad --stage {spec!r} (expected K or K-L)") from None
    if not 1 <= first <= last < n_stages:
        raise ShardlineError(f"--stage {spec!r}: workers host stages 1-{n_stages - 1} (stage 0 is the coordinator's)")
    return first, last


class StageWorker:
    def __init__(self, folder: Path, first: int, last: int, run: RunConfig | None = None) -> None:
        manifest = load_manifest(folder)
        entries = manifest.stages[first : last + 1]
        verify(folder, manifest, only=[f for e in entries for f in (e.xml, e.bin)])
        self.stages = [StageRunner(folder, e, run or RunConfig()) for e in entries]
        self.is_last = entries[-1].has_head
        self.hello = Hello(PROTOCOL, "worker", manifest.model_hash, entries[0].first_layer,
                           entries[-1].last_layer, manifest.weights, "any")
        self._inbox: queue.Queue[tuple[Link, Message]] = queue.Queue()
        self._samplers: dict[int, Sampler] = {}
        self._next: Link | None = None  # downstream worker, when in a daisy chain
        self._reply: Link | None = None  # the coordinator's link
        self._server: socket.socket | None = None
        self.port = 0

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
            server_handshake(link, self.hello, self._check_peer)
            while True:
                self._inbox.put((link, link.recv()))
        except (WireError, Refused) as e:
            log.warning("dropping %s: %s", link.name, e)
        except LinkClosed:
            pass
        link.close()

    # --- execution -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while True:
            link, msg = self._inbox.get()
            try:
                self.handle(link, msg)
            except (LinkClosed, WireError, Refused) as e:
                log.warning("while handling %s from %s: %s", type(msg).__name__, link.name, e)

    def handle(self, link: Link, msg: Message) -> None:
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
            self._forward(msg)
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
            client_handshake(nxt, me, lambda peer: None if peer.first_layer == me.last_layer + 1 else
                             f"next worker starts at layer {peer.first_layer}, expected {me.last_layer + 1}")
            self._next = nxt

    def _forward(self, msg: Forward) -> None:
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
        inputs = StepInputs(_NO_IDS, mask, msg.position_ids)
        out = msg.hidden.astype(np.float32, copy=False)
        for s in self.stages:
            out = s.run(msg.stream, inputs, out)
        if self.is_last:
            self._send_back(self._sample(msg, out))
            return
        hidden = out.astype(msg.hidden.dtype, copy=False)  # activations keep the link's dtype
        fwd = Forward(msg.stream, msg.seq, msg.phase, hidden, msg.attention_mask, msg.position_ids,
                      msg.sampling, msg.want_logits)  # the mask goes on as it came (u8)
        if self._next is not None:
            self._next.send(fwd)
        else:
            self._send_back(fwd)

    def _sample(self, msg: Forward, logits: np.ndarray) -> Sampled:
        sampler = self._samplers.get(msg.stream)
        if sampler is None:
            sampler = self._samplers[msg.stream] = Sampler(SamplingConfig(**msg.sampling))
        row = logits[0, -1]
        choice = sampler.choose(row)
        return Sampled(msg.stream, msg.seq, choice.token, choice.logprob,
                       row.astype(np.float32) if msg.want_logits else None)

    def _send_back(self, msg: Message) -> None:
        if self._reply is None:
            raise LinkClosed("no route to the coordinator yet")
        self._reply.send(msg)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
