"""TetriInfer's workload classes (LPLD, LPHD, HPLD, HPHD, Mixed), rescaled to this model and machine.

The paper calls a prompt heavy above 512 tokens and a decode heavy above 128 generated tokens,
for OPT-13B (2048-token context) on ShareGPT-like prompts. Those numbers do not carry over:
SmolLM2-135M-Instruct has an 8192-token context in our exports, its chat answers are mostly
short (tens to a few hundred tokens), and on these 2 cores prefill runs at a few thousand tokens/s
while one stream decodes at ~100 tokens/s. The default `Thresholds`, all ranges inclusive:

- light prompt 32..128 tokens: a question in its chat template (the template alone makes a
  one-line question ~37 tokens); prefill costs a few tens of ms, a few decode steps' worth.
- heavy prompt 256..1024 tokens: a document and a question; ~0.1-0.5 s of prefill, 8x a light
  prompt's mean, the length of tens of decode steps: enough to stall a coupled instance's
  decodes visibly, which is the interference disaggregation removes.
- light decode 8..32 tokens: a short factual answer, a few tenths of a second.
- heavy decode 64..256 tokens: this model's longer answers, ~0.6-2.6 s; longer ones are rare
  for it, so a length predictor trained on its real outputs still sees heavy requests.

The gaps between light and heavy (129..255 prompt tokens, 33..63 decode tokens) are left out on
purpose: near a single threshold the four classes would blur into each other. The longest
request (1024 + 256 tokens) stays far below the context, and 100 HPHD requests need about
100 * (640 / 3000 + 160 / 100) s ~ 3 minutes even on one unbatched stream: runnable here.

Lengths are uniform integers over the class's inclusive range (so a class's mean is the range's
midpoint); arrivals are a Poisson process: exponential gaps of mean 1/rate from time 0. Mixed is
an even mix of the four classes (counts differ by at most one) in a shuffled order.
Arrivals, the mix and the lengths each come from their own generator spawned from the seed, so
every class of a given seed, rate and count shares the same arrival times: classes are compared
under the same arrivals. No I/O, no model: the benchmark turns each spec into a real request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardline.disagg.state import HEAVY_DECODE_FROM
from shardline.errors import ShardlineError

CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")
MIXED = "Mixed"
KINDS = (*CLASSES, MIXED)

Range = tuple[int, int]  # inclusive (low, high)


def _check_range(name: str, r: Range) -> None:
    if len(r) != 2 or not all(isinstance(v, int) for v in r) or not 1 <= r[0] <= r[1]:
        raise ShardlineError(f"{name} must be a range of integers 1 <= low <= high, got {r!r}")


@dataclass(frozen=True)
class Thresholds:
    """What light and heavy mean in tokens; each range is inclusive (module docstring: why)."""

    light_prompt: Range = (32, 128)
    heavy_prompt: Range = (256, 1024)
    light_decode: Range = (8, 32)
    heavy_decode: Range = (HEAVY_DECODE_FROM, 256)
    context: int = 8192  # the model's context: the longest request must fit it

    def __post_init__(self) -> None:
        ranges = {"light_prompt": self.light_prompt, "heavy_prompt": self.heavy_prompt,
                  "light_decode": self.light_decode, "heavy_decode": self.heavy_decode}
        for name, r in ranges.items():
            _check_range(name, r)
        if self.light_prompt[1] >= self.heavy_prompt[0] or self.light_decode[1] >= self.heavy_decode[0]:
            raise ShardlineError("a light range must end below the start of its heavy range "
                                 f"(prompt {self.light_prompt} vs {self.heavy_prompt}, "
                                 f"decode {self.light_decode} vs {self.heavy_decode})")
        longest = self.heavy_prompt[1] + self.heavy_decode[1]
        if longest > self.context:
            raise ShardlineError(f"the longest request ({longest} tokens) does not fit the context ({self.context})")

    def ranges(self, kind: str) -> tuple[Range, Range]:
        """The (prompt, decode) length ranges of one of CLASSES."""
        if kind not in CLASSES:
            raise ShardlineError(f"no length ranges for {kind!r}; expected one of {', '.join(CLASSES)}")
        prompt = self.heavy_prompt if kind.startswith("HP") else self.light_prompt
        decode = self.heavy_decode if kind.endswith("HD") else self.light_decode
        return prompt, decode


THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Workload:
    kind: str  # one of KINDS
    requests: int
    rate: float  # mean arrivals per second
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShardlineError(f"unknown workload class {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.requests < 1:
            raise ShardlineError(f"a workload needs at least one request, got {self.requests}")
        if not (self.rate > 0 and np.isfinite(self.rate)):  # also refuses NaN
            raise ShardlineError(f"the arrival rate must be a positive finite number per second, got {self.rate}")
        if self.seed < 0:
            raise ShardlineError(f"the seed must be >= 0, got {self.seed}")
        if self.kind == MIXED and self.requests < len(CLASSES):
            raise ShardlineError(f"a Mixed workload needs at least {len(CLASSES)} requests (one per class), "
                                 f"got {self.requests}")


@dataclass(frozen=True)
class RequestSpec:
    index: int  # position in arrival order
    arrival_s: float  # seconds from the start of the run
    prompt_tokens: int
    decode_tokens: int
    kind: str  # one of CLASSES (a Mixed workload's requests each have their own)

    def __post_init__(self) -> None:
        if self.index < 0 or self.arrival_s < 0 or self.prompt_tokens < 1 or self.decode_tokens < 1:
            raise ShardlineError("a request needs index >= 0, arrival >= 0 and at least one prompt and decode token")
        if self.kind not in CLASSES:
            raise ShardlineError(f"a request's class must be one of {', '.join(CLASSES)}, got {self.kind!r}")


def _kinds(workload: Workload, rng: np.random.Generator) -> list[str]:
    if workload.kind != MIXED:
        return [workload.kind] * workload.requests
    # Cycling the classes then shuffling keeps the mix exactly even, whatever the seed.
    cycled = [CLASSES[i % len(CLASSES)] for i in range(workload.requests)]
    return [cycled[i] for i in rng.permutation(workload.requests)]


def _lengths(kinds: list[str], which: int, thresholds: Thresholds, rng: np.random.Generator) -> list[int]:
    """Uniform integers over each request's class range; `which` 0 is the prompt, 1 the decode."""
    bounds = np.array([thresholds.ranges(k)[which] for k in kinds])
    return [int(v) for v in rng.integers(bounds[:, 0], bounds[:, 1], endpoint=True)]


def generate(workload: Workload, thresholds: Thresholds = THRESHOLDS) -> list[RequestSpec]:
    """The workload's requests in arrival order; the same workload always gives the same list."""
    seeds = np.random.SeedSequence(workload.seed).spawn(3)
    arrivals_rng, mix_rng, length_rng = (np.random.default_rng(s) for s in seeds)
    arrivals = np.cumsum(arrivals_rng.exponential(1.0 / workload.rate, size=workload.requests))
    kinds = _kinds(workload, mix_rng)
    prompts = _lengths(kinds, 0, thresholds, length_rng)
    decodes = _lengths(kinds, 1, thresholds, length_rng)
    rows = zip(arrivals, prompts, decodes, kinds, strict=True)
    return [RequestSpec(i, float(a), p, d, k) for i, (a, p, d, k) in enumerate(rows)]


@dataclass(frozen=True)
class ClassStats:
    kind: str  # one of CLASSES, or "all"
    count: int
    mean_prompt: float
    mean_decode: float

    def as_dict(self) -> dict[str, str | int | float]:
        return {"class": self.kind, "count": self.count,
                "mean_prompt": round(self.mean_prompt, 1), "mean_decode": round(self.mean_decode, 1)}


def _stats(kind: str, specs: Sequence[RequestSpec]) -> ClassStats:
    return ClassStats(kind, len(specs), float(np.mean([s.prompt_tokens for s in specs])),
                      float(np.mean([s.decode_tokens for s in specs])))


def describe(specs: Sequence[RequestSpec]) -> dict[str, ClassStats]:
    """Count and mean lengths of each class present (in CLASSES order), then of "all": a bench table's rows."""
    if not specs:
        raise ShardlineError("no requests to describe")
    out = {k: _stats(k, mine) for k in CLASSES if (mine := [s for s in specs if s.kind == k])}
    out["all"] = _stats("all", specs)
    return out
