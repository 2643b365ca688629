"""Mutual TLS under every link: a cluster CA, one certificate per node, nothing in clear.

Both ends present a certificate signed by the cluster's CA (`shardline keygen`) and check the
other's; a peer without one is refused during the TLS handshake, before any shardline frame is
read. Identity is "a node of this cluster", not a host name (nodes are addressed by IP), so host
names are not checked. TLS 1.3 only.

Why memory BIOs rather than ssl.SSLSocket: a link is read by one thread while other threads send
on it, and one OpenSSL connection must not be used by two threads at once (CPython gh-76714;
python-engineio #461 shows the corruption). Here every call into OpenSSL holds the transport's
lock only while it moves bytes between memory buffers; socket I/O happens outside that lock, so
a reader blocked on the socket never holds up a sender. Records reach the socket in the order
OpenSSL made them: they are taken from the outgoing buffer and sent under one send lock.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from shardline.errors import ShardlineError

FILES = ("ca.pem", "cert.pem", "key.pem")  # a node's credentials folder
_RAW = 1 << 16


@dataclass(frozen=True)
class Credentials:
    """A node's credentials folder: the cluster CA's certificate, this node's certificate and key."""

    folder: Path

    @classmethod
    def load(cls, folder: Path) -> Credentials:
        """Checked now (readable, a certificate chain OpenSSL accepts), not at the first link."""
        missing = [f for f in FILES if not (folder / f).is_file()]
        if missing:
            raise ShardlineError(f"credentials {folder}: no {', '.join(missing)} (make them with `shardline keygen`)")
        creds = cls(folder)
        try:
            creds.context(server=True)
        except (ssl.SSLError, OSError) as e:
            raise ShardlineError(f"credentials {folder}: {e}") from None
        return creds

    def context(self, server: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the identity is the cluster CA's signature (see above)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.folder / "cert.pem", self.folder / "key.pem")
        ctx.load_verify_locations(cafile=str(self.folder / "ca.pem"))
        return ctx


class TLSTransport:
    """A connected socket under TLS, with the calls a Link needs (wire/link.Transport)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self._lock = threading.Lock()  # every call into OpenSSL
        self._send_lock = threading.Lock()  # records leave in the order they were made

    def handshake(self, timeout: float) -> None:
        """Before any other use, on one thread; ssl.SSLError (refused) or OSError/TimeoutError."""
        self.sock.settimeout(timeout)
        try:
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    self._pull()
            self._flush()
        finally:
            self.sock.settimeout(None)

    def peer(self) -> str:
        """The peer certificate's common name."""
        subject = cast(tuple[tuple[tuple[str, str], ...], ...], (self._tls.getpeercert() or {}).get("subject", ()))
        names = [value for rdn in subject for key, value in rdn if key == "commonName"]
        return names[0] if names else "?"

    def sendall(self, data: bytes, /) -> None:
        with self._send_lock:
            with self._lock:
                self._tls.write(data)
                out = self._out.read()
            self.sock.sendall(out)

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int:
        """Plaintext into `buffer`; 0 at the end of the stream. The socket's receive timeout
        (SO_RCVTIMEO, set by the link) surfaces as BlockingIOError, as on a plain socket."""
        want = nbytes or len(buffer)
        while True:
            with self._lock:
                try:
                    return cast(int, self._tls.read(want, buffer))  # into a buffer: a count
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    return 0
            self._flush(wait=False)  # what reading made OpenSSL say (post-handshake messages)
            if not self._pull():
                return 0

    def _pull(self) -> bool:
        """Socket bytes into OpenSSL's incoming buffer; False at the end of the stream."""
        raw = self.sock.recv(_RAW)
        with self._lock:
            if raw:
                self._in.write(raw)
            else:
                self._in.write_eof()
        return bool(raw)

    def _flush(self, wait: bool = True) -> None:
        if not self._send_lock.acquire(blocking=wait):
            return  # a sender holds it: it takes these bytes along with its own
        try:
            with self._lock:
                out = self._out.read()
            if out:
                self.sock.sendall(out)
        finally:
            self._send_lock.release()

    # --- what a Link asks of a plain socket, passed through -------------------------------------

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        self.sock.setsockopt(level, option, value)

    def recv(self, n: int, flags: int = 0) -> bytes:
        """For Link.alive's non-blocking peek: raw bytes waiting mean the peer is still there."""
        return self.sock.recv(n, flags)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def client(sock: socket.socket, creds: Credentials, timeout: float) -> TLSTransport:
    transport = TLSTransport(sock, creds.context(server=False), server_side=False)
    transport.handshake(timeout)
    return transport


def server(sock: socket.socket, creds: Credentials, timeout: float) -> TLSTransport:
    transport = TLSTransport(sock, creds.context(server=True), server_side=True)
    transport.handshake(timeout)
    return transport
