"""An instance's own decisions, as pure functions: whether a decode instance admits a request
now, and whether an idle instance changes role.

Admission estimates with the low end of each predicted range (TetriInfer). A prediction is a
bet: a stream that outlives its prediction is never evicted (no request is lost); from then on
its predicted remaining tokens are 0, so it is expected to end at any step and reserves
nothing beyond what it holds. When bets lose, slots run short and a new request waits in the
instance's queue until streams end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from shardline.disagg.state import DecodeLoad, LengthRange, Role
from shardline.errors import ShardlineError


class Admission(Enum):
    VANILLA = "vanilla"  # the prompt's KV fits the free slots now
    RESERVE_STATIC = "reserve-static"  # the predicted use fits now, beside the running streams' predicted growth
    RESERVE_DYNAMIC = "reserve-dynamic"  # ... fits once the running stream predicted to end first has ended


@dataclass(frozen=True)
class Running:
    """A stream decoding on the instance."""

    prompt_tokens: int
    generated: int  # tokens generated so far (each holds a KV slot)
    predicted: LengthRange

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.generated < 0:
            raise ShardlineError(f"a running stream needs prompt tokens >= 1 and generated >= 0, "
                                 f"got {self.prompt_tokens} and {self.generated}")

    @property
    def held(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens it is predicted still to generate: to the low end of its range; 0 once past it."""
        return max(0, self.predicted.lo - self.generated)


def admits(policy: Admission, instance: DecodeLoad, request_range: LengthRange, prompt_tokens: int,
           running: Sequence[Running]) -> bool:
    """Whether the instance starts decoding a request (prompt `prompt_tokens`, decode predicted
    in `request_range`) now. `running` are the instance's streams; their predicted growth is
    the sum of their remaining tokens. With d the stream with the fewest remaining tokens (the
    fewest held slots on a tie: the smaller bet), reserve-dynamic counts as free what d holds
    and would still grow: it admits a request whose predicted use fits then, if its prompt
    fits now. With no running stream, the two reserve policies agree."""
    if prompt_tokens < 1:
        raise ShardlineError(f"a request to admit needs prompt tokens >= 1, got {prompt_tokens}")
    if len(running) != instance.running:
        raise ShardlineError(f"the instance reports {instance.running} running streams, {len(running)} were given")
    need = prompt_tokens + request_range.lo
    predicted_free = instance.free - sum(s.remaining for s in running)
    if policy is Admission.VANILLA:
        return prompt_tokens <= instance.free
    if policy is Admission.RESERVE_STATIC or not running:
        return need <= predicted_free
    first = min(running, key=lambda s: (s.remaining, s.held))
    return prompt_tokens <= instance.free and need <= predicted_free + first.held + first.remaining


@dataclass(frozen=True)
class FlipConfig:
    # Unmeasured starting points, to be tuned on the workloads: ten monitor periods of idleness,
    # and a role's queues under pressure at two waiting requests per instance of that role.
    idle_s: float = 1.0  # an instance idle at least this long may flip
    pressure: float = 2.0  # a role's queue pressure at or past this is "under pressure"

    def __post_init__(self) -> None:
        if not self.idle_s >= 0 or not self.pressure > 0:
            raise ShardlineError(f"a flip needs an idle time >= 0 s and a queue pressure > 0, "
                                 f"got {self.idle_s} and {self.pressure}")


_OTHER = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}


def flip(role: Role, idle_s: float, queue_pressure: Mapping[Role, float], cfg: FlipConfig,
         in_flight: int) -> Role | None:
    """The role an instance takes now, or None to keep its own. `queue_pressure` is each role's
    (prefill, decode) queue pressure, in the unit of `cfg.pressure` (say, waiting requests per
    instance of the role). An instance idle for `cfg.idle_s` flips to the other role when that
    role is under pressure and more so than its own. One with `in_flight` requests never flips:
    they finish where they are first."""
    if role not in _OTHER:
        raise ShardlineError(f"only prefill and decode instances flip, not a {role.value} one")
    if idle_s < 0 or in_flight < 0:
        raise ShardlineError(f"idle time and requests in flight must be >= 0, got {idle_s} and {in_flight}")
    if set(queue_pressure) != set(_OTHER) or min(queue_pressure.values()) < 0:
        raise ShardlineError(f"queue pressure needs a value >= 0 for prefill and decode, got {dict(queue_pressure)}")
    other = _OTHER[role]
    if in_flight or idle_s < cfg.idle_s:
        return None
    hot = queue_pressure[other] >= cfg.pressure and queue_pressure[other] > queue_pressure[role]
    return other if hot else None
