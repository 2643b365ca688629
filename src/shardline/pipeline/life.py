"""A remote pipeline's chain over its life: the links and whether they work, under one lock.

The chain's links are of one connect (an epoch); news of an older chain changes nothing. A
chain breaks once (a link ended, a worker refused or stopped answering): every link is closed
(the workers free the session), every step in flight is lost, and so is every later step that
needs state the chain held (held.py). It is reopened for a stream's first step or a KV import
(`reconnect`, within `reconnect_s`), or in the background while nothing waits on it (`repair`,
backing off), so that /health turns back to ok once a worker is back.

Invariant: a step is either failed by whoever saw the chain break, or refused before it is
sent; never sent into a dead chain (`broken` and `pending` change together, under the lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardline.errors import ShardlineError
from shardline.pipeline.hidden import HiddenChunk
from shardline.pipeline.plan import Step
from shardline.pipeline.ragged_step import RaggedStep
from shardline.pipeline.remote_kv import KvHeld
from shardline.pipeline.repair import reopen
from shardline.wire.link import Link

# While a broken chain is idle it is reopened in the background: attempts of at most REPAIR_S
# each, REPAIR_FIRST_S after the break, then backing off to REPAIR_MAX_S apart (short: a worker
# that comes back is serving again within seconds; an attempt on a dead one costs a refused connect).
REPAIR_S = 3.0
REPAIR_FIRST_S = 0.5
REPAIR_MAX_S = 4.0

Down = frozenset[int]  # the workers (by index) a break names; empty: it cannot tell which


class Lost(ShardlineError):
    """The step cannot run: the chain broke (under it, or since its state was made)."""


@dataclass
class Sent:
    """A step sent down the chain and not yet answered."""

    step: Step | RaggedStep
    started: float = field(default_factory=time.perf_counter)  # for the step's breakdown
    out_at: float = 0.0  # monotonic: when it left for the workers (the watchdog's clock)
    # What the workers should take on it: stage 0's graph time here x the stages after it
    # (they are slices of the same model); its deadline is at least a multiple of this.
    expected_s: float = 0.0
    hidden: dict[int, HiddenChunk] = field(default_factory=dict)  # stage 0's output of each prompt chunk, summarized


class ChainLife:
    """`open_links()` opens a chain (a new session on every worker); `on_links(links, epoch)`
    starts reading a chain just adopted."""

    def __init__(self, open_links: Callable[[], list[Link]], on_links: Callable[[list[Link], int], None],
                 reconnect_s: float) -> None:
        self._open, self._on_links, self.reconnect_s = open_links, on_links, reconnect_s
        self.lock = threading.Lock()
        # Under the lock: the links, their epoch, why they do not work (None: they do), the
        # steps sent on them and not yet answered (by seq, in the order sent), the keys whose
        # state they hold, and when the next background repair is due.
        self.links: list[Link] = []
        self.epoch = 0
        self.broken: str | None = None
        self.down: Down = frozenset()  # whom the break names (placement: those are down)
        self.last_break = ""  # why the chain last broke (what a step whose state went with it says)
        self.adopted_at = time.monotonic()  # when the links were adopted (silence counts from then)
        self.reaching: int | None = None  # the worker a (re)connect is shaking hands with now
        self.pending: dict[int, Sent] = {}
        self.held = KvHeld()
        self.repair_at = float("inf")
        self._repair_gap = REPAIR_FIRST_S
        self._gave_up = float("-inf")  # perf_counter when the last reconnect failed

    def connect(self) -> None:
        """(Re)open every worker link under a new session. Streams of an earlier session are
        gone on the workers (their next steps are lost)."""
        self._adopt(self._open())

    def _adopt(self, links: list[Link]) -> None:
        with self.lock:
            old, self.links = self.links, links
            self.epoch += 1
            epoch, self.broken, self.down = self.epoch, None, frozenset()
            self.adopted_at = time.monotonic()
            self.held.clear()
            self.repair_at, self._repair_gap = float("inf"), REPAIR_FIRST_S
        close_all(old)
        self._on_links(links, epoch)

    def break_(self, reason: str, epoch: int, down: Down = frozenset()) -> list[Sent] | None:
        """The chain of `epoch` is unusable because of the workers `down` (empty: it cannot
        tell): its links are closed (a send blocked on a stopped worker returns) and the steps
        in flight returned, lost. None when it already broke, or a reconnect replaced that
        chain: later news of it changes nothing."""
        with self.lock:
            if epoch != self.epoch or self.broken:
                return None
            self.broken = self.last_break = reason
            self.down = down
            self.repair_at = time.monotonic() + self._repair_gap
            self.held.clear()
            lost, self.pending = list(self.pending.values()), {}
            links = list(self.links)
        close_all(links)
        return lost

    def reconnect(self, made: float) -> None:
        """Reopen the broken chain for a step (a stream's first) or an import planned at `made`,
        or raise Lost saying why. One planned before the last attempt gave up gets that answer
        at once: the streams replayed together wait for one attempt, not one each in turn."""
        if made < self._gave_up:
            raise Lost(self.broken or self.last_break)
        try:
            links = reopen(self._open, self.reconnect_s, close_all)
        except ShardlineError as e:
            self._gave_up = time.perf_counter()
            with self.lock:
                self._failed_again(e)
                self.repair_at = time.monotonic() + self._repair_gap
            raise Lost(self.broken) from None
        self._adopt(links)

    def _failed_again(self, e: ShardlineError) -> None:
        """A reopen failed (under the lock): the worker it was waiting on is the one down now."""
        self.broken = f"{self.last_break}; {e}"
        if self.reaching is not None:
            self.down = frozenset({self.reaching})

    def hurry(self) -> None:
        """A request waits on the broken chain: the next background repair is due now."""
        with self.lock:
            if self.broken and self.repair_at != float("inf"):  # inf: an attempt is under way
                self.repair_at, self._repair_gap = time.monotonic(), REPAIR_FIRST_S

    def repair_due(self, busy: bool) -> bool:
        """Whether a background repair should run now (then none is due until it fails); `busy`:
        steps are waiting to be sent or sent."""
        with self.lock:
            if time.monotonic() < self.repair_at or self.pending or busy:
                return False
            self.repair_at = float("inf")  # until this attempt fails (or a new break)
        return True

    def repair(self) -> bool:
        """One background attempt to reopen a broken chain that nothing is waiting on; whether
        the chain is whole again."""
        with self.lock:
            due = self.broken is not None and not self.pending
        if not due:
            return False
        try:
            links = reopen(self._open, REPAIR_S, close_all)
        except ShardlineError as e:
            with self.lock:
                self._failed_again(e)
                self._repair_gap = min(REPAIR_MAX_S, 2 * self._repair_gap)
                self.repair_at = time.monotonic() + self._repair_gap
            return False
        self._adopt(links)
        return True


def close_all(links: list[Link]) -> None:
    for link in links:
        link.close()
