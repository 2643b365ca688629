"""The remote pipeline's watchdog: a worker that stopped answering breaks the chain.

A worker that dies ends its link at once; one that hangs (stopped, or stuck in a kernel call)
keeps its link open and answers nothing. Every tick the watchdog judges the oldest step in
flight by its deadline (deadline.py) and the KV moves by theirs; the first one overdue breaks
the chain, which loses every step in flight and lets the streams be replayed. Each tick also
lets an idle, broken chain be repaired in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from shardline.pipeline.deadline import StepClock
from shardline.pipeline.life import ChainLife


def overdue(life: ChainLife, clock: StepClock, workers: list[str],
            kv_overdue: Callable[[], str | None]) -> tuple[str, int] | None:
    """Why the chain must break now, and the epoch it concerns (None: nothing is overdue)."""
    with life.lock:
        oldest = next(iter(life.pending.values()), None)
        epoch = life.epoch
        late = oldest and clock.late(oldest.step.phase, oldest.out_at, time.monotonic(), oldest.expected_s)
    who = f"the workers ({', '.join(workers)})"
    if oldest and late:
        return f"{who} did not answer a {oldest.step.phase.value} step within {late:.1f} s (one of them hung?)", epoch
    if why := kv_overdue():
        return f"{who} {why} (one of them hung?)", epoch
    return None


def watch(stopping: threading.Event, clock: StepClock, check: Callable[[], tuple[str, int] | None],
          on_late: Callable[[str, int], None], every_tick: Callable[[], None]) -> None:
    """Until `stopping`: each tick, break the chain (`on_late`) if `check` says so, then
    `every_tick` (a repair queued when one is due)."""
    tick = min(0.25, clock.limits.floor_s / 4)
    while not stopping.wait(tick):
        if (late := check()) is not None:
            on_late(*late)
        every_tick()
