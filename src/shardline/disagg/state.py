"""The control plane's vocabulary: roles, predicted decode lengths, and each instance's load.

The cluster monitor gathers one load record from every instance each period (100 ms) and
builds a `ClusterState`; every scheduling and dispatch decision (policies.py) is a pure
function over it. Prefill and decode instances report different things, so their loads are
distinct types and an instance's type says its role.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType

from shardline.errors import ShardlineError

# A decode predicted to run this many tokens or more is heavy (dispatch weighs heavy decodes
# apart). 64 is where this model's longer chat answers start: tools/shardline_tools/sim/
# workloads.py draws its heavy-decode class from here on.
HEAVY_DECODE_FROM = 64


class Role(Enum):
    COUPLED = "coupled"  # prefill and decode on the same instance: the baseline
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class LengthRange:
    """A predicted decode length: the bucket [lo, hi) in generated tokens; hi None for the
    open last bucket. Decisions that reserve memory use `lo` (TetriInfer's lower end)."""

    lo: int
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.lo < 0 or (self.hi is not None and self.hi <= self.lo):
            raise ShardlineError(f"a length range needs 0 <= lo < hi, got [{self.lo}, {self.hi})")

    def __contains__(self, tokens: int) -> bool:
        return self.lo <= tokens and (self.hi is None or tokens < self.hi)


def bucket(tokens: int, g: int, buckets: int) -> LengthRange:
    """The bucket of a decode of `tokens` tokens: [i*g, (i+1)*g), the last of `buckets` open
    (it holds every length from (buckets-1)*g on). The length predictor's classes."""
    if tokens < 0 or g < 1 or buckets < 1:
        raise ShardlineError(f"bucket needs tokens >= 0, g >= 1 and buckets >= 1, got {tokens}, {g}, {buckets}")
    i = min(tokens // g, buckets - 1)
    return LengthRange(i * g, None if i == buckets - 1 else (i + 1) * g)


def _non_negative(kind: str, **counts: int) -> None:
    wrong = {k: v for k, v in counts.items() if v < 0}
    if wrong:
        raise ShardlineError(f"{kind} load counts must be >= 0, got {wrong}")


@dataclass(frozen=True)
class PrefillLoad:
    queued: int  # requests waiting for their prefill (the one being prefilled included)
    queued_tokens: int  # their prompt tokens not yet prefilled
    busy: bool  # a chunk is in flight

    def __post_init__(self) -> None:
        _non_negative("prefill", queued=self.queued, queued_tokens=self.queued_tokens)
        if self.queued_tokens and not self.queued:
            raise ShardlineError(f"{self.queued_tokens} queued prompt tokens but no queued request")


@dataclass(frozen=True)
class DecodeLoad:
    running: int  # streams decoding
    heavy: int  # of them, predicted heavy (a long decode); the rest are light
    light: int
    used: int  # KV token slots held by the running streams
    total: int  # KV token slots the instance has
    queued: int  # requests transferred or transferring, not yet admitted

    def __post_init__(self) -> None:
        _non_negative("decode", running=self.running, heavy=self.heavy, light=self.light,
                      used=self.used, queued=self.queued)
        if self.heavy + self.light != self.running:
            raise ShardlineError(f"heavy + light streams must be the running streams, "
                                 f"got {self.heavy} + {self.light} != {self.running}")
        if not 0 <= self.used <= self.total or self.total < 1:
            raise ShardlineError(f"KV slots: need 0 <= used <= total and total >= 1, got {self.used} of {self.total}")

    @property
    def free(self) -> int:
        return self.total - self.used


Load = PrefillLoad | DecodeLoad


@dataclass(frozen=True)
class ClusterState:
    """One monitor period's loads, by instance name. Coupled instances are not part of it:
    they take requests whole and need no dispatch."""

    loads: Mapping[str, Load]

    def __post_init__(self) -> None:
        for name, load in self.loads.items():
            if not name or not isinstance(load, PrefillLoad | DecodeLoad):
                raise ShardlineError(f"cluster state: instance {name!r} needs a name and a prefill or decode load")
        # A read-only copy: the state of one period does not change after it is built.
        object.__setattr__(self, "loads", MappingProxyType(dict(self.loads)))

    def prefill(self) -> dict[str, PrefillLoad]:
        return {n: x for n, x in self.loads.items() if isinstance(x, PrefillLoad)}

    def decode(self) -> dict[str, DecodeLoad]:
        return {n: x for n, x in self.loads.items() if isinstance(x, DecodeLoad)}


def sent_prefill(state: ClusterState, name: str, prompt_tokens: int) -> ClusterState:
    """`state` once the front has sent prefill instance `name` a request of `prompt_tokens`
    (until the monitor's next reading shows it)."""
    old = state.prefill().get(name)
    if old is None or prompt_tokens < 1:
        raise ShardlineError(f"cannot count a request of {prompt_tokens} tokens sent to prefill instance {name!r}")
    return ClusterState({**state.loads, name: replace(old, queued=old.queued + 1,
                                                      queued_tokens=old.queued_tokens + prompt_tokens)})


def sent_decode(state: ClusterState, name: str, tokens: int, heavy: bool) -> ClusterState:
    """`state` once a stream predicted to hold `tokens` KV slots (heavy or light) was
    dispatched to decode instance `name`: queued there, with its predicted slots taken."""
    old = state.decode().get(name)
    if old is None or tokens < 1:
        raise ShardlineError(f"cannot count a stream of {tokens} tokens sent to decode instance {name!r}")
    return ClusterState({**state.loads, name: replace(
        old, queued=old.queued + 1, used=min(old.total, old.used + tokens),
        running=old.running + 1, heavy=old.heavy + heavy, light=old.light + (not heavy))})
