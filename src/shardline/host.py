"""What this machine offers and how peers are named: available memory, HOST:PORT addresses."""

from __future__ import annotations

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
