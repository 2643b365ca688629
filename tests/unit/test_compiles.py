"""The compile threads (issue 54): a bounded number of compiles held (running or waiting), past
which a request is a 429; a time limit on each compile's thread CPU clock, which answers the
client while the work it cannot interrupt runs on, still counted; and their CPU held to a share
of one core (a pause after each compile)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shardline.api.constrain import Compiles, _Pace
from shardline.api.schemas import ApiError
from shardline.model.grammar import GrammarError


def _burn(seconds: float) -> str:
    """CPU work that holds its thread (a compile that cannot be interrupted)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    return "done"


def test_a_compile_over_its_cpu_time_is_refused_and_its_thread_stays_counted() -> None:
    async def run() -> None:
        compiles = Compiles(threads=1, waiting=1, cpu_s=0.2, share=1.0)
        try:
            with pytest.raises(GrammarError, match="more than 0.2 s of CPU"):
                await compiles.run(lambda: _burn(2.0), "response_format")
            assert compiles.held == 1  # answered while the work runs on, until llguidance's call returns
            assert await compiles.run(lambda: "quick", "grammar") == "quick"  # waited for the thread
            assert compiles.held == 0
        finally:
            compiles.close()

    asyncio.run(run())


def test_compiles_beyond_the_queue_bound_are_429s() -> None:
    async def run() -> None:
        compiles = Compiles(threads=1, waiting=1, cpu_s=30, share=1.0)
        try:
            held = [asyncio.ensure_future(compiles.run(lambda: _burn(0.3), "tools")) for _ in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(ApiError) as e:
                await compiles.run(lambda: "x", "tools")
            assert (e.value.status, e.value.param, e.value.headers["Retry-After"]) == (429, "tools", "1")
            assert await asyncio.gather(*held) == ["done", "done"]
            assert compiles.held == 0
        finally:
            compiles.close()

    asyncio.run(run())


def test_compiles_take_at_most_their_share_of_a_core() -> None:
    """After a compile of c seconds of CPU, the next waits c * (1 / share - 1); the pause runs
    from the later of the last one's end and now (a clock the test moves)."""
    now = [100.0]
    pace = _Pace(0.25, clock=lambda: now[0])
    assert pace.delay() == 0.0
    pace.spent(0.2)
    assert pace.delay() == pytest.approx(0.6)  # 0.2 s of CPU at a quarter of a core
    now[0] += 0.4
    assert pace.delay() == pytest.approx(0.2)
    pace.spent(0.1)  # another before the pause ended: its pause comes after the first's
    assert pace.delay() == pytest.approx(0.5)
    now[0] += 10
    assert pace.delay() == 0.0


def test_a_compile_waits_its_pause() -> None:
    async def run() -> None:
        compiles = Compiles(threads=1, waiting=4, cpu_s=30, share=0.05)
        try:
            await compiles.run(lambda: _burn(0.1), "grammar")
            assert compiles._pace.delay() > 0  # the next compile is held back (1.9 s from its end)
            assert await compiles.run(lambda: "next", "grammar") == "next"
            assert compiles._pace.delay() == pytest.approx(0.0, abs=0.05)  # it started once the pause was over
        finally:
            compiles.close()

    asyncio.run(run())
