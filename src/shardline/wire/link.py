"""A connection between two shardline processes: framing over a byte stream, and the handshake.

The link only needs `sendall` and `recv_into` from its transport, so TLS (wire/tls.py) replaces
the plain TCP socket without changing a single message.

What a peer can make this process do is bounded. Until the handshake completes a link accepts
only frames of HANDSHAKE_PAYLOAD bytes (a frame's buffer is allocated only after its header is
checked against the link's `max_payload`); the handshake raises it to codec.MAX_PAYLOAD. Once a
frame has begun, all of it must arrive within `frame_timeout`; during the handshake the peer must
answer within `handshake_timeout`. Between frames an established link may stay idle for ever.

The timeouts are the transport's receive timeout (SO_RCVTIMEO), not `settimeout`: a socket's
`settimeout` also applies to the `sendall` another thread may be running on it, which could then
fail half way through a frame. A transport without `setsockopt` just blocks.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from shardline.wire import tls
from shardline.wire.codec import HEADER, MAX_PAYLOAD, WireError, decode_payload, encode, parse_header
from shardline.wire.messages import Hello, Message, Refuse
from shardline.wire.tls import Credentials

_BUFFER = 1 << 16  # receive buffer; grows for a bigger frame, shrinks back once it is read
HANDSHAKE_PAYLOAD = 64 << 10  # largest frame before the handshake: a Hello, a Refuse, a ShardRequest
FRAME_TIMEOUT = 30.0  # seconds from a frame's first byte to its last
HANDSHAKE_TIMEOUT = 10.0  # seconds the peer may take to send each frame of the handshake


def chunk_payload(chunk: int) -> int:
    """The `max_payload` a link needs to receive ShardChunk frames of `chunk` bytes of data: the
    data, plus room for the chunk's names and sizes (as much as any handshake frame may take)."""
    return chunk + HANDSHAKE_PAYLOAD


class Transport(Protocol):
    def sendall(self, data: bytes, /) -> None: ...
    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int: ...
    def close(self) -> None: ...


class LinkClosed(Exception):
    """The peer went away (clean close or reset)."""


class Refused(Exception):
    """The peer refused us, or we refused the peer; the message names both sides."""


class TimedOut(WireError):
    """The peer stopped sending in the middle of a frame, or did not answer during the handshake."""


class Link:
    def __init__(self, transport: Transport, name: str = "peer", *, frame_timeout: float = FRAME_TIMEOUT,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self.transport = transport
        self.name = name
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_decode_s = 0.0  # decode time of the last message `recv` returned (one reader)
        self.peer: Hello | None = None  # the Hello the other side answered with, once shaken hands
        # The largest payload `recv` accepts: small until the handshake raises it (see chunk_payload).
        self.max_payload = HANDSHAKE_PAYLOAD
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self._wait: float | None = None  # longest wait for the next frame to begin; None: for ever
        self._deadline: float | None = None  # when the frame being read must be complete
        self._rcvtimeo: float | None = None  # the transport's receive timeout now (None: none)
        # When bytes last came from the peer (monotonic): a link whose peer answers nothing, not
        # even a Ping, for long is taken as hung (pipeline/watchdog.py).
        self.heard = time.monotonic()
        # Received bytes not yet returned: _buf[_start:_end]. One reader at a time.
        self._buf, self._start, self._end = bytearray(_BUFFER), 0, 0

    @classmethod
    def connect(cls, host: str, port: int, credentials: Credentials | None, timeout: float = 10.0,
                **options: float) -> Link:
        """Under TLS with `credentials` (None: in clear, as --insecure asks); ssl.SSLError when
        the peer refuses ours or shows none. `options`: frame_timeout, handshake_timeout."""
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport: Transport = sock
        if credentials is not None:
            try:
                transport = tls.client(sock, credentials, timeout)
            except BaseException:
                sock.close()
                raise
        return cls(transport, f"{host}:{port}", **options)

    def send(self, msg: Message, stamp: bool = False) -> None:
        """`stamp`: the frame carries its own encode time (codec.encode)."""
        frame = encode(msg, stamp)
        with self._send_lock:
            try:
                self.transport.sendall(frame)
            except OSError as e:
                raise LinkClosed(f"{self.name}: {e}") from None
        self.bytes_sent += len(frame)

    def try_send(self, msg: Message) -> bool:
        """Send `msg` unless another send is under way (a ping need not queue behind a frame,
        whose bytes tell the peer as much). LinkClosed as send."""
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            frame = encode(msg)
            try:
                self.transport.sendall(frame)
            except OSError as e:
                raise LinkClosed(f"{self.name}: {e}") from None
        finally:
            self._send_lock.release()
        self.bytes_sent += len(frame)
        return True

    def recv(self) -> Message:
        """The next message; WireError for a frame that is not ours, or one that stalls half way
        (TimedOut); LinkClosed at the end."""
        self._deadline = None
        kind, length, crc = parse_header(self._read(HEADER.size))
        if length > self.max_payload:  # before its buffer exists
            raise WireError(f"{self.name} announced a frame of {length} bytes; this link accepts at most "
                            f"{self.max_payload}{'' if self.max_payload >= MAX_PAYLOAD else ' for now'}")
        self._begun()
        payload = self._read(length)
        start = time.perf_counter()  # decoding only: waiting for bytes is the wire's time
        msg = decode_payload(kind, payload, crc)
        self.last_decode_s = time.perf_counter() - start
        self.bytes_received += HEADER.size + length
        return msg

    def _read(self, n: int) -> bytes:
        """The next `n` bytes of the stream, as a copy the caller keeps (decoded arrays are views
        into it). Reads go through `_buf` so that a small frame's header and payload usually come
        from one `recv_into` call instead of two."""
        while self._end - self._start < n:
            self._receive(n)
        out = bytes(memoryview(self._buf)[self._start : self._start + n])
        self._start += n
        if self._start == self._end and len(self._buf) > _BUFFER:  # a big frame passed: shrink
            self._buf, self._start, self._end = bytearray(_BUFFER), 0, 0
        return out

    def _receive(self, n: int) -> None:
        """One `recv_into` towards having `n` bytes buffered (moved to the front, room made)."""
        have = self._end - self._start
        if self._start and len(self._buf) - self._start < n:
            self._buf[:have] = self._buf[self._start : self._end]
            self._start, self._end = 0, have
        if self._end == len(self._buf) < n:
            # Grow only as bytes arrive (at most doubling): a header that announces a large
            # frame costs memory only as fast as the peer really sends it.
            self._buf.extend(bytes(min(n, 2 * len(self._buf)) - len(self._buf)))
        if have:
            self._begun()
        try:
            self._set_rcvtimeo(self._wait if self._deadline is None else self._left(have, n))
            k = self.transport.recv_into(memoryview(self._buf)[self._end :], len(self._buf) - self._end)
        except (BlockingIOError, TimeoutError):  # the receive timeout ran out
            raise self._timed_out(have, n) from None
        except OSError as e:
            raise LinkClosed(f"{self.name}: {e}") from None
        if k == 0:
            if have or self._deadline is not None:
                raise WireError(f"truncated frame from {self.name}: {have} of {n} bytes, then end of stream")
            raise LinkClosed(f"{self.name} closed the connection")
        self._end += k
        self.heard = time.monotonic()

    def _begun(self) -> None:
        """A frame has begun: from now on all of it must arrive within the frame timeout."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.frame_timeout

    def _left(self, have: int, n: int) -> float:
        assert self._deadline is not None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out(have, n)
        return left

    def _timed_out(self, have: int, n: int) -> TimedOut:
        if self._deadline is None:
            return TimedOut(f"{self.name} sent nothing for {self._wait or 0:g} s")
        return TimedOut(f"{self.name} sent {have} of {n} bytes and did not complete the frame within "
                        f"{self.frame_timeout:g} s")

    def _set_rcvtimeo(self, seconds: float | None) -> None:
        """The transport's receive timeout (for recv only: a concurrent sendall is not affected)."""
        if seconds == self._rcvtimeo:
            return  # the usual case: no timeout, and none set
        setsockopt = getattr(self.transport, "setsockopt", None)
        if setsockopt is None:
            return
        setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self._rcvtimeo = seconds

    @contextlib.contextmanager
    def handshaking(self) -> Iterator[None]:
        """Within: every frame must begin within `handshake_timeout`, a silent peer is refused
        (Refused, naming it). On success the link accepts frames of up to codec.MAX_PAYLOAD."""
        self._wait = self.handshake_timeout
        try:
            yield
        except TimedOut as e:
            raise refuse(self, f"handshake with {self.name}: {e}") from None
        finally:
            self._wait = None
        self.max_payload = MAX_PAYLOAD

    def alive(self) -> bool:
        """False once the peer has closed or reset the connection (checked without blocking)."""
        peek = getattr(self.transport, "recv", None)
        if peek is None:
            return True
        try:
            return bool(peek(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True  # nothing to read: still connected
        except OSError:
            return False

    def close(self) -> None:
        """End the connection now. shutdown() first: while another thread is blocked reading
        this socket, close() alone neither wakes it nor sends the FIN (the kernel keeps the
        socket open for that read), so the peer would never learn we left."""
        shutdown = getattr(self.transport, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(OSError):
                shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.transport.close()


_LONGEST = 1 << 20  # seconds (12 days): a longer timeout (inf too) is none at all


def _timeval(seconds: float | None) -> bytes:
    """SO_RCVTIMEO's value: 0 is no timeout, so any wait at all is at least one unit."""
    if seconds is not None and not seconds < _LONGEST:
        seconds = None
    if sys.platform == "win32":  # a DWORD of milliseconds
        return struct.pack("<I", 0 if seconds is None else max(1, math.ceil(seconds * 1000)))
    micros = 0 if seconds is None else max(1, math.ceil(seconds * 1e6))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)  # struct timeval


def refuse(link: Link, reason: str) -> Refused:
    """Tell the peer why (if it is still there); the caller raises the result."""
    with contextlib.suppress(LinkClosed):
        link.send(Refuse(reason))
    return Refused(reason)


def _why_not(link: Link, theirs: Message, check: Callable[[Hello], str | None]) -> str | None:
    if not isinstance(theirs, Hello):
        return f"expected Hello from {link.name}, got {type(theirs).__name__}"
    return check(theirs)


def client_handshake(link: Link, mine: Hello, check: Callable[[Hello], str | None],
                     serve: Callable[[Message], None] | None = None) -> Hello:
    """The connecting side speaks first. `check` says why the peer's Hello is unacceptable (or None).

    A refusal from either side travels to the other, so both fail with the same one-line reason.
    Before its Hello the peer may ask for things (a worker without its shard asks for files):
    `serve` answers each such message, or raises `refuse(...)` for what it cannot serve.
    """
    with link.handshaking():
        link.send(mine)
        theirs = link.recv()
        while serve is not None and not isinstance(theirs, Hello | Refuse):
            serve(theirs)
            theirs = link.recv()
        if isinstance(theirs, Refuse):
            raise Refused(theirs.reason)
        if reason := _why_not(link, theirs, check):
            raise refuse(link, reason)
    assert isinstance(theirs, Hello)
    link.peer = theirs
    return theirs


def server_handshake(link: Link, mine: Hello | Callable[[Hello], Hello],
                     check: Callable[[Hello], str | None]) -> Hello:
    """The accepting side answers the peer's Hello with its own, or with a Refuse.

    `mine` may be a function of the peer's Hello: a worker without its shard first fetches it
    from the peer over this link (it may raise `refuse(...)`), and only then knows its Hello.
    """
    with link.handshaking():
        theirs = link.recv()
        if not isinstance(theirs, Hello):
            raise refuse(link, f"expected Hello from {link.name}, got {type(theirs).__name__}")
        answer = mine if isinstance(mine, Hello) else mine(theirs)
        if reason := check(theirs):
            raise refuse(link, reason)
        link.send(answer)
    link.peer = theirs
    return theirs
