"""A user-space WAN emulator (the kernel here has no netem): every byte is delayed by D ms.

Each direction of each connection is a release-time queue: a chunk read at time t is written
at t + D (or later, if a bandwidth cap says the link is still busy), in order. Reading never
waits for writing, so many segments are in flight at once, as on a real long link; a sleep per
read would instead serialize them and add the delay once per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RelayConfig:
    listen_host: str
    listen_port: int
    to_host: str
    to_port: int
    delay_ms: float
    rate_mbit: float | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or (self.rate_mbit is not None and self.rate_mbit <= 0):
            raise ValueError("delay must be >= 0 and rate > 0")


class _Pacer:
    """Release times for one direction: arrival + delay, no earlier than the cap allows."""

    def __init__(self, delay_s: float, bytes_per_s: float | None) -> None:
        self.delay_s, self.bytes_per_s = delay_s, bytes_per_s
        self._link_free = 0.0

    def release_time(self, now: float, size: int) -> float:
        if self.bytes_per_s is None:
            return now + self.delay_s
        start = max(now, self._link_free)
        self._link_free = start + size / self.bytes_per_s
        return self._link_free + self.delay_s


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pacer: _Pacer) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while chunk := await reader.read(1 << 16):
            now = time.monotonic()
            queue.put_nowait((pacer.release_time(now, len(chunk)), chunk))
        queue.put_nowait((0.0, b""))  # end of stream, after everything already queued

    async def write() -> None:
        while True:
            at, chunk = await queue.get()
            if not chunk:
                break
            if (wait := at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    await asyncio.gather(read(), write())


async def _handle(cfg: RelayConfig, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    # On shutdown (Ctrl-C) asyncio cancels every connection's handler, and Python 3.11's stream
    # callback then logs each cancelled handler's traceback: a handler ends quietly instead.
    with contextlib.suppress(asyncio.CancelledError):
        await _connection(cfg, client_r, client_w)


async def _connection(cfg: RelayConfig, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(cfg.to_host, cfg.to_port)
    except OSError:
        client_w.close()
        return
    rate = cfg.rate_mbit * 1e6 / 8 if cfg.rate_mbit else None
    try:
        await asyncio.gather(
            _pump(client_r, server_w, _Pacer(cfg.delay_ms / 1e3, rate)),
            _pump(server_r, client_w, _Pacer(cfg.delay_ms / 1e3, rate)),
        )
    except (ConnectionError, OSError):
        pass
    finally:
        for w in (client_w, server_w):
            w.close()


async def serve(cfg: RelayConfig, ready: asyncio.Future[int] | None = None) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(cfg, r, w), cfg.listen_host, cfg.listen_port)
    port = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready.set_result(port)
    async with server:
        await server.serve_forever()
