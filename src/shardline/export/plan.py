"""Pure planning: which contiguous layer range each stage owns."""

from __future__ import annotations

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
