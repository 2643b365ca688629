"""A run's serving figures from per-request records and per-instance busy time.

Per request (one `RequestRecord` per completed request, times on one clock, in seconds):
- TTFT: arrival to first token; JCT: arrival to last token;
- TPOT: time per output token after the first, (finish - first token) / (tokens - 1); a request
  that generated one token has none (it is left out of the TPOT percentiles and meets any TPOT
  target, since it had no token after the first to be late).

Over the run, whose window runs from the first arrival to the last finish:
- p50/p90/p99 by the nearest-rank rule: the p-th percentile of n values is the ceil(p/100 * n)-th
  smallest, always an observed value (hand-checkable, no interpolation between requests);
- throughput: tokens generated per second of the window;
- goodput: requests per second of the window that met BOTH the TTFT and the TPOT target (`Slo`),
  as DistServe counts it: a fast first token with a slow stream is not a served request;
- instance-seconds busy: each instance's busy intervals clipped to the window (work outside it,
  such as warm-up, served none of these requests) and merged, so overlapping intervals (several
  steps in flight on one instance) count once; summed over instances;
- performance per cost: tokens per busy instance-second (throughput divided by the mean number of
  busy instances) and per provisioned instance-second (every instance, for the whole window:
  what a fleet that cannot scale to zero pays).

Failed requests make no record: the caller counts them. Empty or degenerate inputs raise
ShardlineError saying which figure cannot be computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from shardline.errors import ShardlineError

Interval = tuple[float, float]  # (start, end) seconds, start <= end


@dataclass(frozen=True)
class RequestRecord:
    arrival_s: float
    first_token_s: float
    finish_s: float  # when the last token came out
    tokens: int  # tokens generated, the first one included

    def __post_init__(self) -> None:
        times = (self.arrival_s, self.first_token_s, self.finish_s)
        if not all(math.isfinite(t) for t in times):
            raise ShardlineError(f"a request's times must be finite, got {times}")
        if not self.arrival_s <= self.first_token_s <= self.finish_s:
            raise ShardlineError(f"a request must arrive, then give its first token, then finish; got {times}")
        if self.tokens < 1:
            raise ShardlineError(f"a completed request generated at least one token, got {self.tokens}")

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        return (self.finish_s - self.first_token_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True)
class Slo:
    """The latency target a request must meet to count towards goodput."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v > 0 for v in (self.ttft_s, self.tpot_s)):
            raise ShardlineError(f"SLO targets must be positive finite seconds, got TTFT {self.ttft_s}, "
                                 f"TPOT {self.tpot_s}")

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return r.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the ceil(p/100 * n)-th smallest value, for 0 < p <= 100."""
    if not values:
        raise ShardlineError("a percentile of no values is undefined")
    if not 0 < p <= 100:
        raise ShardlineError(f"a percentile must be in (0, 100], got {p}")
    # Exact decimal arithmetic: 0.9 * 10 in floats is 9.000000000000002, whose ceiling is 10.
    rank = math.ceil(Fraction(str(p)) * len(values) / 100)
    return sorted(values)[rank - 1]


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99))


def _checked(intervals: Iterable[Interval]) -> list[Interval]:
    spans = list(intervals)
    for lo, hi in spans:
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ShardlineError(f"a busy interval must be finite with start <= end, got ({lo}, {hi})")
    return spans


def merged_seconds(intervals: Iterable[Interval]) -> float:
    """Seconds covered by the union of the intervals: time covered twice counts once."""
    total, end = 0.0, -math.inf
    for lo, hi in sorted(_checked(intervals)):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def instance_seconds_busy(busy: Mapping[str, Sequence[Interval]], window: Interval) -> float:
    """Each instance's busy time within the window (intervals clipped, then merged), summed."""
    lo, hi = window
    clipped = ([(max(a, lo), min(b, hi)) for a, b in _checked(spans) if b > lo and a < hi] for spans in busy.values())
    return sum(merged_seconds(spans) for spans in clipped)


@dataclass(frozen=True)
class Summary:
    requests: int
    tokens: int
    duration_s: float  # the window: first arrival to last finish
    slo: Slo
    ttft_s: Percentiles
    jct_s: Percentiles
    tpot_s: Percentiles
    throughput_tps: float  # tokens per second of the window
    goodput_rps: float  # requests per second of the window that met both SLO targets
    slo_attainment: float  # the share of requests that met both
    busy_instance_s: float
    provisioned_instance_s: float
    tokens_per_busy_instance_s: float
    tokens_per_provisioned_instance_s: float

    def as_dict(self) -> dict[str, int | float]:
        """Flat, rounded to 0.1 ms (or 1e-4 of a rate): one JSON line of a benchmark."""
        out: dict[str, int | float] = {"requests": self.requests, "tokens": self.tokens,
                                       "duration_s": self.duration_s,
                                       "slo_ttft_s": self.slo.ttft_s, "slo_tpot_s": self.slo.tpot_s}
        for name, pct in (("ttft", self.ttft_s), ("jct", self.jct_s), ("tpot", self.tpot_s)):
            out |= {f"{name}_p50_s": pct.p50, f"{name}_p90_s": pct.p90, f"{name}_p99_s": pct.p99}
        out |= {"throughput_tps": self.throughput_tps, "goodput_rps": self.goodput_rps,
                "slo_attainment": self.slo_attainment, "busy_instance_s": self.busy_instance_s,
                "provisioned_instance_s": self.provisioned_instance_s,
                "tokens_per_busy_instance_s": self.tokens_per_busy_instance_s,
                "tokens_per_provisioned_instance_s": self.tokens_per_provisioned_instance_s}
        return {k: v if isinstance(v, int) else round(v, 4) for k, v in out.items()}


def _window(records: Sequence[RequestRecord]) -> Interval:
    if not records:
        raise ShardlineError("no completed requests to summarize")
    start, end = min(r.arrival_s for r in records), max(r.finish_s for r in records)
    if end <= start:
        raise ShardlineError("the run lasted no time (last finish at the first arrival): rates are undefined")
    return start, end


def _tpots(records: Sequence[RequestRecord]) -> list[float]:
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    if not tpots:
        raise ShardlineError("no request generated two tokens: time per output token is undefined")
    return tpots


def summarize(records: Sequence[RequestRecord], busy: Mapping[str, Sequence[Interval]], instances: int,
              slo: Slo) -> Summary:
    """The run's figures; `busy` maps an instance to its busy intervals, `instances` counts every
    instance provisioned (an idle one may have no intervals)."""
    start, end = window = _window(records)
    if instances < max(1, len(busy)):
        raise ShardlineError(f"{instances} instances provisioned, but {len(busy)} have busy intervals")
    busy_s = instance_seconds_busy(busy, window)
    if busy_s <= 0:
        raise ShardlineError("no instance was busy during the run: performance per cost is undefined")
    duration, tokens = end - start, sum(r.tokens for r in records)
    met = sum(slo.met(r) for r in records)
    provisioned = instances * duration
    return Summary(
        requests=len(records), tokens=tokens, duration_s=duration, slo=slo,
        ttft_s=Percentiles.of([r.ttft_s for r in records]), jct_s=Percentiles.of([r.jct_s for r in records]),
        tpot_s=Percentiles.of(_tpots(records)), throughput_tps=tokens / duration, goodput_rps=met / duration,
        slo_attainment=met / len(records), busy_instance_s=busy_s, provisioned_instance_s=provisioned,
        tokens_per_busy_instance_s=tokens / busy_s, tokens_per_provisioned_instance_s=tokens / provisioned)
