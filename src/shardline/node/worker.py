"""A stage worker: hosts a contiguous run of stages and serves the chains that use them.

Threads: one acceptor, one reader per connection (it decodes frames and queues them; it also
connects a session's next hop when its coordinator sends a Route, so a slow peer delays only
its own link), and one executor that runs every queued item in arrival order, so a stream's
steps never race and a bad connection never stalls the others.

Sessions: each coordinator link is one session (the random id in its Hello). Its streams and
decode groups live under (session, key) on the stages, so coordinators sharing this worker
never see each other's streams or replies; a worker's link from the previous worker names the
session it carries. A Route is taken only from the session's own coordinator link. When that
link drops, everything the session held is freed. A key's KV leaves or enters the stages
(KvPull, KvPush: node/kv.py) in the order of the coordinator's link, as its Releases do.

A Ping is answered by the link's reader at once (a Pong), not queued behind steps: its
coordinator tells a stopped worker from a busy one with no traffic (pipeline/watchdog.py).

Nothing a peer sends ends the process: a frame the codec refuses or a message that has no
business on a link closes that link; a step that does not fit the state fails that step alone
(StepFailed to its coordinator); any other exception while handling an item is logged. Nor does
it stall the others: a peer that stops reading loses its link once a send to it has made no
progress for the frame timeout (the one executor would otherwise wait on it for ever).

A worker may start without its shard (`fetch=True`, as `shardline worker` does): the first
coordinator that connects delivers whatever the folder lacks during the handshake (shard.py,
delivery.py); the stages load then and the files stay cached for the next start.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np

from shardline.config import RunConfig, WorkerConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.host import available_memory, parse_hostport, trim_memory_every
from shardline.node import kv, paged
from shardline.node.bounds import Bounds
from shardline.node.execute import masks_refusal, run_stages, sampled, work_of
from shardline.node.session import MAX_QUEUED, Ended, Item, Received, Routed, Session, check_peer
from shardline.node.shard import Shard
from shardline.stage.runners import Stage
from shardline.wire import tls
from shardline.wire.codec import WireError
from shardline.wire.hops import with_rows
from shardline.wire.link import (
    FRAME_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    Link,
    LinkClosed,
    Refused,
    Transport,
    _timeval,
    client_handshake,
    refuse,
    server_handshake,
)
from shardline.wire.messages import (
    LOST_NEXT,
    Forward,
    Hello,
    KvCopy,
    KvDone,
    KvPart,
    KvPull,
    KvPush,
    Message,
    Ping,
    Pong,
    Ragged,
    Refuse,
    Release,
    Role,
    Route,
    Sampled,
    StepFailed,
)
from shardline.wire.tls import Credentials

log = logging.getLogger("shardline.worker")
_ACCEPT_RETRY_S = 0.1  # out of file descriptors: wait a moment, keep accepting


class StageWorker:
    def __init__(self, folder: Path, first: int, last: int, run: RunConfig | None = None, *,
                 fetch: bool = False, frame_timeout: float = FRAME_TIMEOUT,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, credentials: Credentials | None = None,
                 config: WorkerConfig | None = None) -> None:
        """Serve stages first-last of the export in `folder` (shard.py: present, or fetched from
        the first coordinator with `fetch`). `frame_timeout` and `handshake_timeout` apply to
        every link (wire/link.py; tests make them short); `frame_timeout` also bounds how long a
        send may make no progress. With `credentials` every link, in or out, is mutual TLS
        (wire/tls.py); without, in clear (`--insecure`). `config`: what it gives (KV pools)."""
        self.credentials = credentials
        # What every session's KV pools may take together (a paged export's): fixed at start.
        self.kv_limit = (config or WorkerConfig()).kv_limit(available_memory())
        self._joining = threading.Lock()  # one coordinator's pools sized and attached at a time
        self.shard = Shard(folder, first, last, run or RunConfig(), fetch)
        self.frame_timeout, self.handshake_timeout = frame_timeout, handshake_timeout
        # By id: a reader adds its coordinator's (setdefault: atomic), the executor removes it.
        self.sessions: dict[str, Session] = {}
        self._session_nos = count()
        self._inbox: queue.Queue[Item] = queue.Queue()
        self._server: socket.socket | None = None
        self._bounds: Bounds | None = None  # once the stages are loaded
        self._stopping = False
        self.port = 0

    @classmethod
    def empty(cls, folder: Path, first: int, last: int, run: RunConfig | None = None,
              credentials: Credentials | None = None) -> StageWorker:
        """A worker that takes its shard from the first coordinator unless `folder` holds it."""
        return cls(folder, first, last, run, fetch=True, credentials=credentials)

    @property
    def stages(self) -> list[Stage]:
        return self.shard.stages

    @property
    def hello(self) -> Hello | None:
        return self.shard.hello

    @property
    def bounds(self) -> Bounds:
        """What a frame may cost here (node/bounds.py); asked only once the stages are loaded."""
        if self._bounds is None:
            hello = self.hello
            assert hello is not None, "bounds before the stages are loaded"
            self._bounds = Bounds.of(self.stages, hello.context)
        return self._bounds

    @property
    def received_bytes(self) -> int:
        return self.shard.received_bytes

    # --- connections ---------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        self._server = socket.create_server((host, port))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="accept").start()
        return self.port

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stopping:
            try:
                sock, addr = self._server.accept()
            except OSError as e:
                if self._stopping or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # the socket was closed: stop() was called
                log.warning("accept failed (%s); still accepting", e)
                time.sleep(_ACCEPT_RETRY_S)  # e.g. out of file descriptors: the others go on
                continue
            # Whatever goes wrong setting up one connection (a reset socket, no thread to read it:
            # out of threads or memory) costs that connection only: the acceptor must not die.
            try:
                threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True,
                                 name="read").start()
            except Exception as e:  # noqa: BLE001
                log.warning("cannot serve %s:%s (%s); still accepting", addr[0], addr[1], e)
                with contextlib.suppress(OSError):
                    sock.close()

    def _serve(self, sock: socket.socket, name: str) -> None:
        """One connection, on its own thread: TLS first (a peer without credentials of this
        cluster is refused here, before any frame is read, and logged), then its link."""
        transport: Transport = sock
        if self.credentials is not None:
            try:
                transport = tls.server(sock, self.credentials, self.handshake_timeout)
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                log.warning("refused %s: TLS handshake failed (%s)", name, e)
                with contextlib.suppress(OSError):
                    sock.close()
                return
        self._read(self._link(sock, transport, name))

    def _link(self, sock: socket.socket, transport: Transport, name: str) -> Link:
        """A link on a connected socket, with this worker's timeouts. A send that makes no
        progress for the frame timeout fails (SO_SNDTIMEO, which leaves the reader's receive
        timeout alone): Link.send raises LinkClosed, and the link is closed (see _send)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.frame_timeout))
        return Link(transport, name, frame_timeout=self.frame_timeout, handshake_timeout=self.handshake_timeout)

    def _check_peer(self, peer: Hello) -> str | None:
        assert self.shard.hello is not None  # checked after _ready_for
        return check_peer(self.shard.hello, peer, self.sessions)

    def _read(self, link: Link) -> None:
        """Per connection: handshake, then queue every message; a bad peer loses only its link."""
        joined: list[Session] = []  # its session, once the peer's Hello is accepted
        try:
            server_handshake(link, lambda p: self.shard.ready_for(link, p), lambda p: self._join(link, p, joined))
            session = joined[0]
            slot = threading.Semaphore(MAX_QUEUED)  # this link's items not yet taken by the executor
            while True:
                msg = link.recv()
                if isinstance(msg, Route):
                    self._route(link, session, msg)
                    continue
                if isinstance(msg, Ping):  # here, not queued: a busy executor is not a hung worker
                    self._send(link, Pong(msg.seq))
                    continue
                slot.acquire()  # bounded: the executor takes items as fast as it can
                self._inbox.put(Received(link, session, msg, link.last_decode_s, time.perf_counter(), slot))
        except (WireError, Refused, ShardlineError) as e:
            log.warning("dropping %s: %s", link.name, e)
        except LinkClosed:
            pass
        except Exception:  # noqa: BLE001 - a bug must cost this link only
            log.exception("dropping %s", link.name)
        link.close()
        if joined and joined[0].coordinator is link:
            self._inbox.put(Ended(joined[0]))

    def _join(self, link: Link, peer: Hello, joined: list[Session]) -> str | None:
        """Why `peer` may not join (None: it joined, its session appended to `joined`). A
        coordinator's session exists here before this worker's Hello answers it: the coordinator
        routes the previous worker here next, whose Hello must find the session (when it was
        attached after the answer, a worker slow to schedule that reader refused it)."""
        if why := self._check_peer(peer):
            return why
        session = self._attach(link, peer)
        if isinstance(session, str):
            return session
        joined.append(session)
        return None

    def _attach(self, link: Link, peer: Hello) -> Session | str:
        """The session this link belongs to: a new one for a coordinator, its coordinator's for
        the previous worker of a chain; or why not (checked by _check_peer, re-checked here under
        the race)."""
        if peer.role == Role.COORDINATOR:
            with self._joining:  # else two Hellos at once could each fit beside the same pools
                return self._new_session(link, peer)
        known = self.sessions.get(peer.session)
        if known is None:
            return f"no coordinator of session {peer.session[:8]} is connected here"
        return known

    def _new_session(self, link: Link, peer: Hello) -> Session | str:
        """A coordinator's session with its pools (a paged export's), or why not."""
        taken = paged.reserved([s.pools for s in list(self.sessions.values())])
        pools = paged.pools_for(self.shard.paged, peer, taken, self.kv_limit) if self.shard.paged else None
        if isinstance(pools, str):
            return pools
        session = Session(peer.session, next(self._session_nos), link, pools=pools)
        if self.sessions.setdefault(peer.session, session) is not session:
            return f"session {peer.session[:8]} is already connected"
        return session

    def _route(self, link: Link, session: Session, msg: Route) -> None:
        """Connect the session's next hop (on this link's reader: only this link waits)."""
        if link is not session.coordinator:
            raise refuse(link, "a Route is taken only from the session's coordinator")
        nxt = None
        if msg.next:
            me = self.hello
            assert me is not None  # a Route comes only after this worker's Hello
            try:
                host, port = parse_hostport(msg.next, "the next worker")
                nxt = Link.connect(host, port, self.credentials, frame_timeout=self.frame_timeout,
                                   handshake_timeout=self.handshake_timeout)
                # As on accepted links: a next worker that stops reading cannot hold the executor.
                assert isinstance(nxt.transport, socket.socket | tls.TLSTransport)
                nxt.transport.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.frame_timeout))
                mine = replace(me, session=session.id)
                client_handshake(nxt, mine, lambda peer: None if peer.first_layer == me.last_layer + 1 else
                                 f"next worker starts at layer {peer.first_layer}, expected {me.last_layer + 1}")
            # ValueError: a host name the resolver cannot even encode (UnicodeError from the IDNA
            # codec, e.g. "..:7001"); before, it escaped as a traceback and the coordinator heard nothing.
            except (OSError, ValueError, ShardlineError, Refused, LinkClosed, WireError) as e:
                if nxt is not None:
                    nxt.close()
                raise refuse(link, f"cannot reach the next worker {msg.next}: {e}") from None
            threading.Thread(target=self._drain, args=(nxt,), daemon=True, name="next").start()
        self._inbox.put(Routed(session, nxt))

    def _drain(self, nxt: Link) -> None:
        """The next worker never answers on our link, but a refusal or garbage ends it."""
        try:
            msg = nxt.recv()
            log.warning("the next worker %s sent %s; closing that link", nxt.name, type(msg).__name__)
        except Exception:  # noqa: BLE001 - any end of that link
            pass
        nxt.close()

    # --- execution -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        trim_memory_every()  # sessions come and go for as long as this runs
        while True:
            # Bounded: a signal that lands while this thread is on its way into an unbounded
            # wait (handing the GIL over) would not interrupt it, and Ctrl-C would be lost.
            self.handle_next(0.2)

    def handle_next(self, timeout: float | None) -> bool:
        """Handle one queued item (False when none came within `timeout`). Never raises."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        if isinstance(item, Received) and item.slot is not None:
            item.slot.release()
        try:
            self._handle(item)
        except Exception:  # noqa: BLE001 - the worker outlives any item
            log.exception("while handling %s", type(item).__name__)
        return True

    def _handle(self, item: Item) -> None:
        if isinstance(item, Routed):
            if item.session.next is not None and item.session.next is not item.next:
                item.session.next.close()  # a Route again: the link it replaces goes (else kept until the end)
            item.session.next, item.session.routed = item.next, True
            for held in item.session.held:
                self._handle(held)
            item.session.held = []
        elif isinstance(item, Ended):
            self._end(item.session)
        elif item.session.id not in self.sessions:
            return  # a message of a session that has ended
        elif isinstance(item.msg, Forward | Ragged):
            if item.session.routed:
                self._step(item)
            elif len(item.session.held) < MAX_QUEUED:
                item.session.held.append(item)
            else:  # a coordinator that floods steps before its Route: drop it
                refuse(item.session.coordinator, f"more than {MAX_QUEUED} steps before a Route")
                item.session.coordinator.close()
        elif isinstance(item.msg, Release) and item.link is item.session.coordinator:
            for stage in self.stages:
                stage.close((item.session.no, item.msg.key))
        elif isinstance(item.msg, KvPull | KvPush | KvPart | KvCopy) and item.link is item.session.coordinator:
            self._move_kv(item.session, item.msg)
        elif isinstance(item.msg, Refuse):
            log.warning("%s refused this worker: %s", item.link.name, item.msg.reason)
            item.link.close()
        else:
            refuse(item.link, f"a worker does not take {type(item.msg).__name__} here")
            item.link.close()

    def _end(self, session: Session) -> None:
        """The coordinator is gone: free everything its session held, close its next hop."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        for stage in self.stages:
            for key in stage.keys():  # noqa: SIM118 - a Stage, not a dict
                if isinstance(key, tuple) and key[0] == session.no:
                    stage.close(key)
        if session.next is not None:
            session.next.close()

    def _move_kv(self, session: Session, msg: KvPull | KvPush | KvPart | KvCopy) -> None:
        """A KV pull or push of the session's coordinator, in the order of its link (node/kv.py).
        A push's parts follow it, all of them before the next push: a part outside a push, or a
        push before the last one's parts are in, means the two ends no longer agree on what the
        link carries, and it is closed (the session ends; the worker and its others go on)."""
        link = session.coordinator
        if isinstance(msg, KvPull):
            if why := self._not_for_me(msg, session):
                return self._send(link, KvDone(msg.seq, 0, why))
            replies = kv.pull(self.stages, (session.no, msg.key), msg) if session.pools is None else \
                paged.pull(self.shard.paged, session.pools, msg)
            for reply in replies:
                self._send(link, reply)
            return
        if isinstance(msg, KvCopy):
            why = self.bounds.copy(msg) or ("a paged worker copies no KV (its blocks are shared)"
                                            if session.pools is not None else None)
            return self._send(link, KvDone(msg.seq, 0, why) if why else kv.copy(self.stages, session.no, msg))
        push = session.push
        in_order = isinstance(msg, KvPush) if push is None else (isinstance(msg, KvPart) and msg.seq == push.msg.seq)
        if in_order:
            return self._push(session, msg)
        refuse(link, f"{type(msg).__name__} {msg.seq} out of order: " +
               (f"the parts of push {push.msg.seq} are due" if push else "no KV push is under way"))
        link.close()

    def _push(self, session: Session, msg: KvPush | KvPart) -> None:
        """A push's parts, each checked as it comes; the last writes them (a key's state, or a
        paged session's blocks) or says why not."""
        pools = session.pools
        if isinstance(msg, KvPush):
            refused = self._not_for_me(msg, session) or self.bounds.push(msg)
            session.push = push = kv.begin(self.stages, msg, refused) if pools is None or refused else \
                paged.begin(self.shard.paged, pools, msg, refused)
        else:
            assert session.push is not None
            push = session.push
            if pools is None:
                kv.add(self.stages, push, msg)
            else:
                paged.add(self.shard.paged, push, msg)
        if push.got == push.msg.parts:
            session.push = None
            done = kv.finish(self.stages, (session.no, push.msg.key), push) if pools is None else \
                paged.finish(self.shard.paged, pools, push)
            self._send(session.coordinator, done)

    @staticmethod
    def _not_for_me(msg: KvPull | KvPush, session: Session) -> str | None:
        """Why a move does not fit this worker's kind of stages: blocks to one holding keys, a
        key's state to one holding blocks."""
        if (msg.blocks is None) == (session.pools is None):
            return None
        return ("this worker's stages are paged: a KV move names blocks" if session.pools is not None else
                "this worker's stages are not paged: a KV move names no blocks")

    def _step(self, item: Received) -> None:
        """A step through this worker's stages, then on: to the next worker or back. A step that
        fails, fails alone: its coordinator hears why (StepFailed)."""
        msg, session = item.msg, item.session
        assert isinstance(msg, Forward | Ragged)
        graph_s: list[float] = []
        hops = lambda: self._hops(msg, graph_s, item)  # noqa: E731 - taken last, after sampling
        try:
            if why := masks_refusal(msg.allow_bits, self.shard.vocab):
                raise StepRefused(why)
            reply = self._forward(msg, session, graph_s, hops) if isinstance(msg, Forward) else \
                self._ragged(msg, session, graph_s, hops)
        except Exception as e:  # noqa: BLE001 - the step fails alone, and its coordinator hears why
            why = str(e) if isinstance(e, StepRefused) else f"{type(e).__name__}: {e}"
            return self._send(session.coordinator, StepFailed(getattr(msg, "key", 0), msg.seq, why))
        self._pass_on(session, reply)

    def _forward(self, msg: Forward, session: Session, graph_s: list[float], hops: Callable[[], np.ndarray]) -> Message:
        if self.shard.paged:
            raise StepRefused("this worker's stages are paged: it runs ragged steps (Ragged), not Forward")
        if why := self.bounds.forward(msg):  # before the mask is made or a state grows
            raise StepRefused(why)
        work = work_of(msg, lambda k: (session.no, k))
        out = run_stages(self.stages, work, msg, graph_s, time.perf_counter)
        return sampled(msg, work, out, hops) if self.shard.is_last else \
            replace(msg, hidden=out.astype(msg.hidden.dtype, copy=False), hops=hops())

    def _ragged(self, msg: Ragged, session: Session, graph_s: list[float], hops: Callable[[], np.ndarray]) -> Message:
        if session.pools is None:
            raise StepRefused("this worker's stages are not paged: it runs Forward steps, not Ragged")
        batch = paged.batch_of(msg)
        out = paged.run(self.shard.paged, session.pools, msg, batch, graph_s, time.perf_counter)
        return paged.sampled(msg, batch, out, hops) if self.shard.is_last else \
            replace(msg, hidden=out.astype(msg.hidden.dtype, copy=False), hops=hops())

    def _pass_on(self, session: Session, reply: Message) -> None:
        if self.shard.is_last or session.next is None:  # end of chain, or a star: back to the coordinator
            return self._send(session.coordinator, reply)
        try:
            session.next.send(reply, stamp=True)
        except LinkClosed as e:  # tell the coordinator now, rather than leave its step hanging
            session.next.close()  # it may end in the middle of a frame (a send that timed out)
            session.next = None
            me = self.hello
            assert me is not None
            refuse(session.coordinator, f"the worker for layers {me.first_layer}-{me.last_layer} "
                                        f"{LOST_NEXT}: {e}")
            session.coordinator.close()

    def _hops(self, msg: Forward | Ragged, graph_s: list[float], item: Received) -> np.ndarray:
        """The incoming rows plus this worker's; taken last before encoding, so host time covers
        everything since the frame was decoded (queueing, casts, sampling) but graph and encode."""
        host_s = time.perf_counter() - item.decoded_at - sum(graph_s)
        return with_rows(msg.hops, self.shard.indices, graph_s, item.decode_s, host_s)

    @staticmethod
    def _send(link: Link, msg: Message) -> None:
        try:
            link.send(msg, stamp=isinstance(msg, Forward | Ragged | Sampled))
        except LinkClosed:
            # Gone, or not reading (the send timed out, perhaps half way through a frame): close
            # it either way; its reader sees the end and frees the session.
            link.close()

    def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
