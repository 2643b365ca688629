"""Pings on a remote pipeline's quiet links, so that a worker that stopped is seen with no traffic.

A worker answers a Ping on its link's reader (node/worker.py), whatever its executor is doing;
a link's `heard` is when bytes last came from its peer. A link that carries frames is never
pinged (its frames say as much), so a busy chain pays a ping only on links that carry nothing
back: in a daisy chain, every worker's but the last one's (a few dozen bytes a second). The
watchdog (watchdog.py) breaks the chain once a link is silent past the window.
"""

from __future__ import annotations

import contextlib
import threading
import time
from itertools import count

from shardline.pipeline.life import ChainLife
from shardline.wire.link import Link, LinkClosed
from shardline.wire.messages import Ping

PINGS_PER_WINDOW = 5  # a quiet link is pinged this often within the heartbeat window


def quiet_for(window_s: float) -> float:
    """How long a pinged link may stay silent before its worker counts as hung: the window
    minus one ping period, so that the watchdog's tick still fits in the window."""
    return window_s * (1 - 1 / PINGS_PER_WINDOW)


def settle_for(window_s: float) -> float:
    """How long after a step went out every quiet link has surely been pinged and could answer:
    a beat may just miss a link (two periods), plus a margin for the answer (0: no pings)."""
    return 2 * window_s / PINGS_PER_WINDOW + 0.5 if window_s else 0.0


def ping_quiet(links: list[Link], every_s: float, seqs: count[int]) -> int:
    """A Ping on each link nothing came from for `every_s`; how many were sent. A link whose
    send is under way is skipped (Link.try_send); one that is closed is left to its reader."""
    now, sent = time.monotonic(), 0
    for link in links:
        if now - link.heard >= every_s:
            with contextlib.suppress(LinkClosed):
                sent += link.try_send(Ping(next(seqs)))
    return sent


def beat(stopping: threading.Event, life: ChainLife, window_s: float) -> None:
    """Until `stopping`: ping the quiet links of the chain in use (none while it is broken)."""
    every, seqs = window_s / PINGS_PER_WINDOW, count()
    while not stopping.wait(every):
        with life.lock:
            links, broken = list(life.links), life.broken
        if not broken:
            ping_quiet(links, every, seqs)
