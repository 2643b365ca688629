"""A connection between two shardline processes: framing over a byte stream, and the handshake.

The link only needs `sendall` and `recv_into` from its transport, so a TLS socket (or any
authenticated, encrypting wrapper with the same two calls) can replace the plain TCP socket
without changing a single message.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from shardline.wire.codec import HEADER, WireError, decode_payload, encode, parse_header
from shardline.wire.messages import Hello, Message, Refuse

_BUFFER = 1 << 16  # receive buffer; grows for a bigger frame, shrinks back once it is read


class Transport(Protocol):
    def sendall(self, data: bytes, /) -> None: ...
    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int: ...
    def close(self) -> None: ...


class LinkClosed(Exception):
    """The peer went away (clean close or reset)."""


class Refused(Exception):
    """The peer refused us, or we refused the peer; the message names both sides."""


class Link:
    def __init__(self, transport: Transport, name: str = "peer") -> None:
        self.transport = transport
        self.name = name
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_decode_s = 0.0  # decode time of the last message `recv` returned (one reader)
        # Received bytes not yet returned: _buf[_start:_end]. One reader at a time.
        self._buf, self._start, self._end = bytearray(_BUFFER), 0, 0

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0) -> Link:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, f"{host}:{port}")

    def send(self, msg: Message, stamp: bool = False) -> None:
        """`stamp`: the frame carries its own encode time (codec.encode)."""
        frame = encode(msg, stamp)
        with self._send_lock:
            try:
                self.transport.sendall(frame)
            except OSError as e:
                raise LinkClosed(f"{self.name}: {e}") from None
        self.bytes_sent += len(frame)

    def recv(self) -> Message:
        """The next message; WireError for a frame that is not ours, LinkClosed at the end."""
        kind, length, crc = parse_header(self._read(HEADER.size))
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
        if len(self._buf) < n:
            self._buf.extend(bytes(n - len(self._buf)))
        try:
            k = self.transport.recv_into(memoryview(self._buf)[self._end :], len(self._buf) - self._end)
        except OSError as e:
            raise LinkClosed(f"{self.name}: {e}") from None
        if k == 0:
            if have:
                raise WireError(f"truncated frame from {self.name}: {have} of {n} bytes, then end of stream")
            raise LinkClosed(f"{self.name} closed the connection")
        self._end += k

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
        with contextlib.suppress(OSError):
            self.transport.close()


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
    return theirs


def server_handshake(link: Link, mine: Hello | Callable[[Hello], Hello],
                     check: Callable[[Hello], str | None]) -> Hello:
    """The accepting side answers the peer's Hello with its own, or with a Refuse.

    `mine` may be a function of the peer's Hello: a worker without its shard first fetches it
    from the peer over this link (it may raise `refuse(...)`), and only then knows its Hello.
    """
    theirs = link.recv()
    if not isinstance(theirs, Hello):
        raise refuse(link, f"expected Hello from {link.name}, got {type(theirs).__name__}")
    answer = mine if isinstance(mine, Hello) else mine(theirs)
    if reason := check(theirs):
        raise refuse(link, reason)
    link.send(answer)
    return theirs
