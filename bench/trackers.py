"""The token times of engine requests, for the benchmarks that time streams by hand (not a benchmark)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from shardline.serving.engine import Event


class Tracker:
    """An engine request's callback: when each of its tokens came, and how it ended."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        self.finish = ""  # its finish reason, with the error if it failed
        self.error = ""

    def __call__(self, ev: Event) -> None:
        if ev.token is not None:
            self.times.append(time.perf_counter())
        if ev.finish:
            self.finish = ev.finish + (f": {ev.error}" if ev.error else "")
            self.error = ev.error if ev.finish == "error" else ""
            self.done.set()


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `cond` until it holds; RuntimeError("<what> within <timeout> s") if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:g} s")
        time.sleep(0.005)
