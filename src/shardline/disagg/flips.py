"""Which instances change role now (TetriInfer's instance flip), as pure functions over the
cluster monitor's readings.

Each period the monitor reads every load; an instance with nothing queued, running or in
flight is idle, and `IdleClock` remembers since when. `due` names the flips to make now: an
instance idle for `FlipConfig.idle_s` whose other role is under pressure (instance.flip), at most
one per period (the next reading shows what it changed), and never the last instance of a role
(its requests would have nowhere to go). The front end makes the flip only once the instance is
verifiably empty, so no request is in flight on it when it changes: none has to move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shardline.disagg.instance import FlipConfig, flip
from shardline.disagg.state import ClusterState, Load, PrefillLoad, Role


@dataclass(frozen=True)
class Flipped:
    """A role change that happened: when (seconds on the monitor's clock), which, from and to."""

    at_s: float
    name: str
    old: Role
    new: Role


def role_of(load: Load) -> Role:
    return Role.PREFILL if isinstance(load, PrefillLoad) else Role.DECODE


def in_flight(load: Load) -> int:
    """Requests an instance holds: queued or prefilling, or arriving or decoding."""
    if isinstance(load, PrefillLoad):
        return load.queued + load.busy
    return load.running + load.queued


def pressure(state: ClusterState) -> dict[Role, float]:
    """Each role's queue pressure: requests waiting per instance of the role (a prefill
    instance's queued requests; a decode instance's arrivals not yet admitted)."""
    out = {}
    for role, loads in ((Role.PREFILL, state.prefill()), (Role.DECODE, state.decode())):
        out[role] = sum(x.queued for x in loads.values()) / len(loads) if loads else 0.0
    return out


class IdleClock:
    """Since when each instance has been idle, from the monitor's readings."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def read(self, state: ClusterState, now: float) -> dict[str, float]:
        """Seconds each instance of `state` has been idle at `now` (0 for one with work)."""
        busy = {n for n, x in state.loads.items() if in_flight(x)}
        self._since = {n: self._since.get(n, now) for n in state.loads if n not in busy}
        return {n: now - self._since[n] if n in self._since else 0.0 for n in state.loads}


def due(state: ClusterState, idle_s: Mapping[str, float], cfg: FlipConfig) -> tuple[str, Role] | None:
    """The instance that flips now and its new role, or None: among those flip() moves, the one
    idle longest (then by name); none that is the last of its role."""
    heat = pressure(state)
    counts = {Role.PREFILL: len(state.prefill()), Role.DECODE: len(state.decode())}
    ready = []
    for name, load in state.loads.items():
        role = role_of(load)
        new = flip(role, idle_s.get(name, 0.0), heat, cfg, in_flight(load))
        if new is not None and counts[role] > 1:
            ready.append((-idle_s.get(name, 0.0), name, new))
    if not ready:
        return None
    _, name, new = min(ready, key=lambda r: (r[0], r[1]))
    return name, new
