"""The remote pipeline's watchdog: a worker that stopped answering breaks the chain.

A worker that dies ends its link at once; one that hangs (stopped, or stuck in a kernel call)
keeps its link open and answers nothing. Idle links carry pings (heartbeat.py), so every tick
the watchdog first looks for a link that has been silent past the heartbeat window, then
judges the oldest step in flight by its deadline (deadline.py) and the KV moves by theirs; the
first one overdue breaks the chain, which loses every step in flight and lets the streams be
replayed. A break names the workers it blames: the silent one, or those not heard from since
the late step went out (every worker when all were quiet). Each tick also lets an idle, broken
chain be repaired in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from shardline.pipeline.deadline import StepClock
from shardline.pipeline.life import ChainLife, Down
from shardline.wire.link import Link

Late = tuple[str, int, Down]  # why the chain must break, the epoch it concerns, whom it blames


def overdue(life: ChainLife, clock: StepClock, workers: list[str], kv_overdue: Callable[[], str | None],
            quiet_s: float = 0.0, settle_s: float = 0.0) -> Late | None:
    """Why the chain must break now (None: nothing is overdue). `quiet_s`: how long a link may
    send nothing at all while it is pinged (0: no pings, no such check). `settle_s`: a late step
    is judged only once it has been out this long, so that every quiet link has had a ping to
    answer since: the workers that answered are not blamed."""
    now = time.monotonic()
    with life.lock:
        oldest = next(iter(life.pending.values()), None)
        epoch, broken, links, since = life.epoch, life.broken, list(life.links), life.adopted_at
        late = oldest and now - oldest.out_at >= settle_s and \
            clock.late(oldest.step.phase, oldest.out_at, now, oldest.expected_s)
    if broken:
        return None
    if quiet_s and (silence := silent(links, since, quiet_s)):
        i, s = silence[0]
        return (f"worker {workers[i]} sent nothing for {s:.1f} s, not even an answer to a ping "
                f"(stopped or unreachable?)", epoch, frozenset(j for j, _ in silence))
    if oldest and late:
        quiet = [i for i, link in enumerate(links) if link.heard < oldest.out_at]
        down = frozenset(quiet) if 0 < len(quiet) < len(links) else frozenset()
        step = f"did not answer a {oldest.step.phase.value} step within {late:.1f} s"
        if down:
            return f"worker {', '.join(workers[i] for i in sorted(down))} {step}", epoch, down
        return f"the workers ({', '.join(workers)}) {step} (one of them hung?)", epoch, down
    if why := kv_overdue():
        return f"the workers ({', '.join(workers)}) {why} (one of them hung?)", epoch, frozenset()
    return None


def silent(links: list[Link], since: float, quiet_s: float) -> list[tuple[int, float]]:
    """(worker, seconds) of every link nothing came from for more than `quiet_s` (counted from
    `since` at the earliest: when the links were adopted)."""
    now = time.monotonic()
    quiet = [(i, now - max(link.heard, since)) for i, link in enumerate(links)]
    return [(i, s) for i, s in quiet if s > quiet_s]


def watch(stopping: threading.Event, clock: StepClock, check: Callable[[], Late | None],
          on_late: Callable[[str, int, Down], None], every_tick: Callable[[], None]) -> None:
    """Until `stopping`: each tick, break the chain (`on_late`) if `check` says so, then
    `every_tick` (a repair queued when one is due)."""
    tick = min(0.25, clock.limits.floor_s / 4)
    while not stopping.wait(tick):
        if (late := check()) is not None:
            on_late(*late)
        every_tick()
