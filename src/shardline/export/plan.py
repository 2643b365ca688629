"""Pure planning: which contiguous layer range each stage owns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardline.errors import ShardlineError


@dataclass(frozen=True)
class StagePlan:
    """Stage `index` of `n_stages` owns decoder layers [first, last] (inclusive).

    Ownership invariant: stage 0 also owns the token embedding and the last stage owns the final
    norm and the lm_head; every other stage is decoder layers only.
    """

    index: int
    n_stages: int
    first: int
    last: int

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def has_embedding(self) -> bool:
        return self.index == 0

    @property
    def has_head(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def name(self) -> str:
        return f"stage{self.index}"


def even_split(n_layers: int, n_stages: int) -> list[StagePlan]:
    """Split evenly; the remainder goes one layer each to the first stages (as the paper does)."""
    if n_stages < 1:
        raise ShardlineError(f"--stages must be at least 1, got {n_stages}")
    if n_stages > n_layers:
        raise ShardlineError(f"cannot split {n_layers} layers into {n_stages} stages (more stages than layers)")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        ranges.append((start, start + size - 1))
        start += size
    return _plans(ranges)


def balanced_split(n_layers: int, n_stages: int, head_layers: float) -> list[StagePlan]:
    """Split so each stage does about the same work per token, counting the last stage's
    lm_head as `head_layers` decoder layers of weight to stream and multiply. In a pipeline
    serving several streams, the slowest stage sets the pace: with SmolLM2-135M the head weighs
    8 layers, so an even 15 + 15 split leaves the second stage 1.5x the first's work."""
    if n_stages < 1 or n_stages > n_layers:
        return even_split(n_layers, n_stages)  # its errors
    share = (n_layers + head_layers) / n_stages
    ranges, start = [], 0
    for i in range(n_stages - 1):
        later = n_stages - 1 - i  # stages after this one: each needs at least one layer
        end = min(max(round((i + 1) * share), start + 1), n_layers - later)
        ranges.append((start, end - 1))
        start = end
    ranges.append((start, n_layers - 1))
    return _plans(ranges)


@dataclass(frozen=True)
class StageCosts:
    """What a split weighs, in bytes: a decoder layer's work per token (the weights it reads:
    a mixture's active experts only) and size (the memory it holds: every expert), the head's
    work, and the size the first stage (embedding) and the last (final norm, head) add."""

    layer_work: float
    layer_size: float
    head_work: float
    first_size: float
    last_size: float

    def __post_init__(self) -> None:
        if not (self.layer_work > 0 and self.layer_size > 0 and min(self.head_work, self.first_size,
                                                                     self.last_size) >= 0):
            raise ShardlineError(f"stage costs must be positive: {self}")

    def extra(self, stage: int, n_stages: int) -> float:
        return (self.first_size if stage == 0 else 0.0) + (self.last_size if stage == n_stages - 1 else 0.0)


def fitted_split(n_layers: int, budgets: Sequence[float], c: StageCosts) -> list[StagePlan]:
    """Split into len(budgets) stages so that stage s's size fits budgets[s] (bytes) first, then
    the slowest stage's work per token is as small as it can be. Mixture-of-experts layers weigh
    far more in memory than in time, so a memory-poor node takes fewer layers than its share
    of the work; a dense model with room everywhere splits as balanced_split does."""
    n = len(budgets)
    if n < 1 or n > n_layers:
        return even_split(n_layers, n)  # its errors
    caps = [n_layers if b == math.inf else min(n_layers, math.floor((b - c.extra(s, n)) / c.layer_size))
            for s, b in enumerate(budgets)]
    _check_room(n_layers, budgets, caps, c)
    head = [c.head_work if s == n - 1 else 0.0 for s in range(n)]

    def counts(limit: float) -> list[int]:  # the most layers each stage takes within `limit`
        return [max(0, min(cap, math.floor((limit - h) / c.layer_work + 1e-9)))
                for cap, h in zip(caps, head, strict=True)]

    limits = sorted({k * c.layer_work + h for k in range(1, n_layers + 1) for h in (0.0, c.head_work)})
    best = next(t for t in limits if all(counts(t)) and sum(counts(t)) >= n_layers)
    sizes = counts(best)
    while sum(sizes) > n_layers:  # drop a layer from the busiest stage that has one to spare
        s = max((s for s in range(n) if sizes[s] > 1), key=lambda s: (sizes[s] * c.layer_work + head[s], s))
        sizes[s] -= 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size - 1))
        start += size
    return _plans(ranges)


def _check_room(n_layers: int, budgets: Sequence[float], caps: list[int], c: StageCosts) -> None:
    gib = 1 << 30
    for s, cap in enumerate(caps):
        if cap < 1:
            need = (c.extra(s, len(caps)) + c.layer_size) / gib
            raise ShardlineError(f"stage {s}'s memory ({budgets[s] / gib:.1f} GiB) cannot hold even one layer: "
                                 f"it needs about {need:.1f} GiB")
    if sum(caps) < n_layers:
        total = (n_layers * c.layer_size + c.first_size + c.last_size) / gib
        raise ShardlineError(f"the {n_layers} layers need about {total:.1f} GiB across the stages, more than "
                             f"their memory holds ({sum(budgets) / gib:.1f} GiB): add memory or stages")


def parse_layers(spec: str, n_layers: int, flag: str = "--layers") -> list[StagePlan]:
    """Parse an explicit split such as "0-9,10-19,20-29": contiguous, complete, non-empty.

    `flag` names the option in error messages (`--plan` takes the same syntax)."""
    ranges = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ShardlineError(f"bad layer range {part!r} in {flag} {spec!r} (expected A-B)") from None
        if last < first:
            raise ShardlineError(f"empty layer range {part!r} in {flag} {spec!r}")
        ranges.append((first, last))
    expect = 0
    for first, last in ranges:
        if first != expect:
            raise ShardlineError(f"{flag} {spec!r} is not contiguous: expected a range starting at {expect}")
        expect = last + 1
    if expect != n_layers:
        raise ShardlineError(f"{flag} {spec!r} covers layers 0-{expect - 1} but the model has {n_layers}")
    return _plans(ranges)


def _plans(ranges: list[tuple[int, int]]) -> list[StagePlan]:
    return [StagePlan(i, len(ranges), a, b) for i, (a, b) in enumerate(ranges)]
