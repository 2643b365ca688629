"""What this machine offers and how peers are named: available memory, HOST:PORT addresses; the
heap given back to the OS in long-running processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import threading
import time

import psutil

from shardline.errors import ShardlineError


def available_memory() -> int:
    """Bytes this machine can still give without swapping (psutil; Linux MemAvailable)."""
    return int(psutil.virtual_memory().available)


def parse_hostport(spec: str, what: str = "address") -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets: `[::1]:7001`) as (host, port), or a one-line error
    naming `what` (a flag, a peer). The port may be 0 (any free port) where a caller binds."""
    host, sep, port = spec.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ShardlineError(f"{what} must be HOST:PORT with a port in 0-65535, got {spec!r}")
    return host, int(port)


def machines(peers: list[str], local: set[str]) -> int:
    """How many machines run this process and the `peers` (HOST:PORT): a loopback host, or
    one of `local` (this machine's own addresses), is this machine; other hosts count once each.
    Pure: the scheduler keeps one step in flight per machine (issue 56), since stages that share
    a machine share its cores, and a second step out there only contends with the first."""
    others = set()
    for peer in peers:
        host = parse_hostport(peer, "a worker's address")[0].lower()
        if host != "localhost" and host not in local and not _loopback(host):
            others.add(host)
    return 1 + len(others)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def local_addresses() -> set[str]:
    """This machine's own addresses (every interface's), lower-case, and its host names."""
    import socket

    addresses = {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs}
    return addresses | {socket.gethostname().lower(), socket.getfqdn().lower()}


TRIM_EVERY_S = 30.0
_trimming = threading.Event()


def trim_memory_every(period_s: float = TRIM_EVERY_S) -> None:
    """Give the heap glibc holds free back to the OS every `period_s`, on a daemon thread (once per
    process; nothing where there is no glibc). Why: streams and sessions come and go (a replay
    opens fresh ones on every stage), each with its own buffers allocated from several threads;
    glibc keeps what they free in its arenas, so without this a long-running process's RSS
    creeps up under churn although nothing leaks (BENCHMARKS.md, issue 11 soak)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    if _trimming.is_set():
        return
    _trimming.set()

    def loop() -> None:
        while True:
            time.sleep(period_s)
            trim(0)

    threading.Thread(target=loop, daemon=True, name="trim-memory").start()
