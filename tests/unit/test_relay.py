"""The delay relay keeps bytes and their order, delays each direction, and keeps many chunks in
flight (a lower bound on the added delay is behaviour; no speed figures here)."""

from __future__ import annotations

import asyncio
import time

from shardline.cluster.relay import RelayConfig, _Pacer, serve


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _through_relay(delay_ms: float, chunks: list[bytes]) -> tuple[bytes, list[float], float]:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    cfg = RelayConfig("127.0.0.1", 0, "127.0.0.1", echo.sockets[0].getsockname()[1], delay_ms)
    relay = asyncio.create_task(serve(cfg, ready))
    port = await ready
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    for c in chunks:  # written back to back: all in flight together
        writer.write(c)
        await writer.drain()
    got, arrivals = b"", []
    want = sum(len(c) for c in chunks)
    while len(got) < want:
        got += await reader.read(1 << 16)
        arrivals.append(time.monotonic() - start)
    writer.close()
    relay.cancel()
    echo.close()
    return got, arrivals, start


def test_bytes_and_order_survive_and_each_direction_is_delayed() -> None:
    chunks = [bytes([i]) * 1000 for i in range(40)]
    got, arrivals, _ = asyncio.run(_through_relay(60, chunks))
    assert got == b"".join(chunks)
    # there and back: nothing can come back before two delays
    assert arrivals[0] >= 0.12
    # in flight together: the last chunk is not 40 delays behind the first
    assert arrivals[-1] - arrivals[0] < 40 * 0.06


def test_pacer_spaces_chunks_by_the_rate_cap() -> None:
    pacer = _Pacer(delay_s=0.01, bytes_per_s=1000.0)
    assert pacer.release_time(0.0, 500) == 0.5 + 0.01
    assert pacer.release_time(0.1, 500) == 1.0 + 0.01  # waits for the link to be free
    assert pacer.release_time(5.0, 100) == 5.1 + 0.01
    assert _Pacer(0.02, None).release_time(3.0, 10**6) == 3.02
