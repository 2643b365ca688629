"""The front of disaggregated serving: one object the HTTP app serves through, in front of P
prefill and D decode instances (TetriInfer's global scheduler, cluster monitor and the
prefill instances' dispatcher).

- A cluster monitor thread reads every instance's load each `period` (100 ms) into one
  ClusterState.
- `submit` sends a request to the least-loaded prefill instance; `dispatch` (called by a
  prefill instance for each prefilled stream) picks its decode instance by power of two
  choices. Both decide with policies.py's pure functions over the last state, with what this
  front sent since then added (state.py `sent_prefill` / `sent_decode`): without that, every
  request of a burst inside one period would go to the same instance.
- A cancel goes to every instance: the one holding the stream ends it, the others only mark
  the ticket (an instance that receives it later drops it).

It offers what the app uses of an Engine (submit, cancel, waiting, active, failed, limits,
speculating, spec_ended, stop).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardline.disagg.decode import DecodeRole
from shardline.disagg.flips import Flipped, IdleClock, due
from shardline.disagg.instance import FlipConfig
from shardline.disagg.policies import dispatch, is_heavy, least_loaded_prefill
from shardline.disagg.prefill import Moving, PrefillRole
from shardline.disagg.state import ClusterState, Role, sent_decode, sent_prefill
from shardline.errors import ShardlineError
from shardline.pipeline.plan import Pipeline, Placed
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request, Ticket
from shardline.serving.kv_blocks import BlockCounts
from shardline.serving.prefix import PrefixStats
from shardline.serving.speculation import SpecStats

log = logging.getLogger("shardline.disagg")

Instance = PrefillRole | DecodeRole  # an engine in that role (.engine)
Make = Callable[[Role, Pipeline], Instance]
MONITOR_PERIOD_S = 0.1  # TetriInfer's cluster monitor period


@dataclass(frozen=True)
class FrontConfig:
    heavy_from: int  # decode tokens from which a predicted decode counts as heavy
    period_s: float = MONITOR_PERIOD_S
    seed: int = 0  # the dispatcher's power-of-two draws
    flip: FlipConfig | None = None  # None: roles are fixed

    def __post_init__(self) -> None:
        if self.heavy_from < 1 or not 0 < self.period_s <= 10:
            raise ShardlineError(f"the front needs heavy_from >= 1 and a monitor period in (0, 10] s, "
                                 f"got {self.heavy_from} and {self.period_s}")


class Disaggregated:
    def __init__(self, cfg: FrontConfig) -> None:
        self.cfg = cfg
        self.prefills: dict[str, PrefillRole] = {}
        self.decodes: dict[str, DecodeRole] = {}
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()  # guards _state and _rng (callers' and prefill engines' threads)
        self._state = ClusterState({})
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._make: Make | None = None
        self._idle = IdleClock()
        self.flips: list[Flipped] = []  # role changes so far (the monitor's thread appends)
        self._prefix_before = PrefixStats()  # of engines replaced by flips: the counters never go back

    def start(self, prefills: dict[str, PrefillRole], decodes: dict[str, DecodeRole],
              make: Make | None = None) -> None:
        """Serve through these instances (built with `self.dispatch` as their send); `make`
        builds an instance of a role over a pipeline when one flips."""
        if not prefills or not decodes or prefills.keys() & decodes.keys():
            raise ShardlineError("disaggregated serving needs >= 1 prefill and >= 1 decode instance, named apart")
        if self.cfg.flip is not None and make is None:
            raise ShardlineError("instance flips need a way to build an instance of the other role")
        self.prefills, self.decodes, self._make = prefills, decodes, make
        self._gather()
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="cluster-monitor")
        self._monitor.start()

    @property
    def state(self) -> ClusterState:
        with self._lock:
            return self._state

    # --- what the app uses ---------------------------------------------------------------------

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket:
        with self._lock:  # held through the submit: an instance taken out to flip gets nothing after
            covered = {n: r.engine.prefix_covers(request) for n, r in self.prefills.items()}
            name = least_loaded_prefill(self._state, covered)
            self._state = sent_prefill(self._state, name, max(1, len(request.prompt) - covered.get(name, 0)))
            return self.prefills[name].engine.submit(request, on_event)

    def dispatch(self, moving: Moving) -> None:
        """A prefilled stream's decode instance (a prefill engine's thread calls this)."""
        heavy = is_heavy(moving.predicted, self.cfg.heavy_from)
        with self._lock:
            name = dispatch(self._state, moving.prompt_tokens, moving.predicted, self._rng, self.cfg.heavy_from)
            self._state = sent_decode(self._state, name, moving.prompt_tokens + moving.predicted.lo, heavy)
            self.decodes[name].adopt(moving)

    def cancel(self, ticket: Ticket) -> None:
        for engine in self._engines():
            engine.cancel(ticket)

    @property
    def waiting(self) -> int:
        return sum(e.waiting for e in self._engines())

    @property
    def active(self) -> int:
        return sum(e.active for e in self._engines())

    @property
    def failed(self) -> str | None:
        return next((f"{n}: {r.engine.failed}" for n, r in self._named() if r.engine.failed), None)

    @property
    def stalled(self) -> str | None:
        return next((f"{n}: {r.engine.stalled}" for n, r in self._named() if r.engine.stalled), None)

    def kv_blocks(self) -> BlockCounts | None:
        """Every paged instance's pool together (None: no instance is paged)."""
        counts = [c for e in self._engines() if (c := e.kv_blocks()) is not None]
        return sum(counts[1:], counts[0]) if counts else None

    @property
    def limits(self) -> Limits:
        return Limits(sum(r.engine.limits.max_streams for r in self.decodes.values()),
                      sum(r.engine.limits.max_queue for r in self.prefills.values()))

    def speculating(self) -> dict[int, SpecStats]:
        return {}  # decode instances do not speculate (yet)

    @property
    def spec_ended(self) -> SpecStats:
        return SpecStats(0, 0, 0, 0)

    def prefix_stats(self) -> tuple[PrefixStats, int]:
        """Prefix reuse over every instance (prefill instances keep prompts; decode ones none)."""
        with self._lock:  # the pools and the counts of engines flipped away, read together
            total = self._prefix_before
            engines = [r.engine for r in self.prefills.values()] + [r.engine for r in self.decodes.values()]
        held = 0
        for engine in engines:
            stats, n = engine.prefix_stats()
            total, held = total + stats, held + n
        return total, held

    def stop(self) -> None:
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        for engine in self._engines():
            engine.stop()

    def shutdown(self) -> None:
        """Stop, then close every instance's pipeline."""
        self.stop()
        for engine in self._engines():
            engine.pipe.shutdown()

    # --- the cluster monitor -------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(self.cfg.period_s):
            try:
                state = self._gather()
                if self.cfg.flip is not None:
                    self._flip_if_due(state)
            except Exception:  # noqa: BLE001 - a bad reading keeps the last state; the monitor goes on
                log.exception("the cluster monitor could not read a load or flip an instance")

    def _gather(self) -> ClusterState:
        state = ClusterState({n: e.load() for n, e in self._named()})
        with self._lock:
            self._state = state
        return state

    def _flip_if_due(self, state: ClusterState) -> None:
        assert self.cfg.flip is not None and self._make is not None
        now = time.monotonic()
        if (chosen := due(state, self._idle.read(state, now), self.cfg.flip)) is None:
            return
        name, new = chosen
        if (taken := self._take_out(name)) is None:
            return
        taken.engine.stop()
        taken.engine.drop_prefixes()  # the pipeline goes on under an engine that knows none of them
        fresh = self._make(new, taken.engine.pipe)
        with self._lock:
            if isinstance(fresh, PrefillRole):
                self.prefills[name] = fresh
            else:
                self.decodes[name] = fresh
        old = Role.DECODE if new is Role.PREFILL else Role.PREFILL
        self.flips.append(Flipped(now, name, old, new))
        log.info("instance %s flipped from %s to %s", name, old.value, new.value)

    def _take_out(self, name: str) -> Instance | None:
        """Instance `name` out of routing, if it is still empty (none of its requests in flight)
        and not the last of its role; None (and left in place) otherwise."""
        with self._lock:
            taken: Instance | None = self.prefills.get(name) or self.decodes.get(name)
            peers = len(self.prefills) if isinstance(taken, PrefillRole) else len(self.decodes)
            if taken is None or peers < 2 or not taken.engine.empty():
                return None
            self.prefills.pop(name, None)
            self.decodes.pop(name, None)
            # an empty engine's counts no longer change: they stay in the front's from now on
            self._prefix_before = self._prefix_before + taken.engine.prefix_stats()[0]
            self._state = ClusterState({n: x for n, x in self._state.loads.items() if n != name})
            return taken

    def placements(self) -> dict[str, list[Placed]]:
        """Each instance's chain, by name (/health: every one must be up)."""
        return {name: e.engine.pipe.placement() for name, e in self._named()}

    def _named(self) -> list[tuple[str, Instance]]:
        """Every instance, by name: a snapshot (a flip changes the pools on the monitor's thread)."""
        with self._lock:
            return [*self.prefills.items(), *self.decodes.items()]

    def engines(self) -> list[Engine]:
        """Every instance's engine (a snapshot)."""
        return self._engines()

    def _engines(self) -> list[Engine]:
        return [e.engine for _, e in self._named()]
