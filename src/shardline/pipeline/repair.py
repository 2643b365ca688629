"""Reopening a broken chain, within a bounded time.

A worker that was killed refuses connections until it is restarted: attempts fail fast and are
retried. A worker that is stopped (hung) accepts the connection in its kernel but never answers
the handshake, for as long as the handshake allows (minutes: a worker may be compiling its
shard). So each attempt runs on a thread of its own and is waited for only until the window
closes; an attempt still waiting then is abandoned, and whatever it opens later is discarded
(closed), never used: the caller has moved on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from shardline.errors import ShardlineError

T = TypeVar("T")
PAUSE_S = 0.2  # between attempts that failed fast (a worker not listening yet)


def reopen(attempt: Callable[[], T], window_s: float, discard: Callable[[T], None], pause_s: float = PAUSE_S) -> T:
    """`attempt()` until it succeeds, for at most `window_s` in all; ShardlineError with the
    last attempt's reason after that."""
    deadline = time.monotonic() + window_s
    while True:
        try:
            return _Attempt(attempt, discard).result(deadline - time.monotonic())
        except ShardlineError as e:
            if time.monotonic() + 2 * pause_s > deadline:  # no fair time left for another attempt
                raise ShardlineError(f"reconnecting for {window_s:g} s failed: {e}") from None
            time.sleep(pause_s)


class _Attempt(Generic[T]):
    """One call of `fn` on its own thread; its outcome is taken, or the call abandoned (then a
    result is handed to `discard`). `_outcome` and `_abandoned` change under the lock only."""

    def __init__(self, fn: Callable[[], T], discard: Callable[[T], None]) -> None:
        self._fn, self._discard = fn, discard
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._outcome: tuple[T] | Exception | None = None
        self._abandoned = False
        threading.Thread(target=self._run, daemon=True, name="reconnect").start()

    def _run(self) -> None:
        try:
            outcome: tuple[T] | Exception = (self._fn(),)
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            outcome = e
        with self._lock:
            if not self._abandoned:
                self._outcome = outcome
                self._done.set()
                return
        if isinstance(outcome, tuple):
            self._discard(outcome[0])

    def result(self, seconds: float) -> T:
        self._done.wait(max(0.0, seconds))
        with self._lock:
            outcome = self._outcome
            if outcome is None:
                self._abandoned = True
                raise ShardlineError(f"no answer within {max(0.0, seconds):.1f} s")
        if isinstance(outcome, tuple):
            return outcome[0]
        if isinstance(outcome, ShardlineError):
            raise outcome
        raise ShardlineError(f"{type(outcome).__name__}: {outcome}")
