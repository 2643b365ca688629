"""What one instance's work costs in seconds: the simulator's only source of time.

The model (all terms >= 0, fitted by least squares from measured steps, `Costs.fit`):
- a prefill chunk of n positions whose cache already holds c tokens:
    prefill_base_s + prefill_token_s * m + prefill_token_ctx_s * m * c,  m = max(n, prefill_knee_tokens)
  (a fixed cost per step, each position's own work, and its attention over the cache). The knee
  (0, the default: off) is an accelerator's saturation point: below it a chunk leaves the device
  underused and takes as long as a chunk of the knee (TetriInfer's premise for its fixed 512-token
  chunks of OPT-13B on a V100; a CPU has no such knee, so its fits leave it off);
- a decode step of R rows, each attending over c positions:
    decode_base_s + decode_row_s * R + decode_row_ctx_s * R * c
  (the weights streamed once per call whatever the rows, then each row's arithmetic and KV);
- moving B bytes of KV from a prefill to a decode instance: transfer_latency_s + B / transfer_bytes_per_s;
- regrouping a decode group's state of R rows by w slots (B = R x w x KV bytes per token): a step
  that merges joiners into kept rows adds B / merge_bytes_per_s (the state is read out, merged on
  the host, set back, and the plugin takes it in on the next inference: the slow part); a step
  that drops rows (beam_idx) or compacts the state adds B / drop_bytes_per_s (a gather);
- KV bytes per token, and the KV tokens an instance holds (what its admission counts against).

DEFAULTS are rough figures read off BENCHMARKS.md, not a calibration (issue 13 point 10 asks for
one from real runs: fit it, save it with `to_json`, and say which one a table used):
- prefill: least squares over "Issue 9: chunked prefill" table (a), chunks 16-256 (the engine's
  128 among them): 14.8 ms per step + 1.24 ms per position + 1.6 us per position per cached token,
  within 10% of every cell it was fitted on (2-stage in-process gguf export, exact precision);
- decode: 14.4 ms for a one-row step at a 400-slot cache ("Issue 10": what a verify step costs,
  2-stage gguf, one new token), split as the issue 4 "Batching" table's fits split a step (20.3 ms
  + 5.03 ms per row at ctx 256, 21.2 + 3.88 at ctx 64, 2 threads): fixed ~78%, a row 3.5 ms + 6 us
  per slot there, scaled by 14.4 / 26.6. It gives 1.7x / 2.5x / 3.4x a row's tokens per second
  at 2 / 4 / 8 rows at ctx 256 (measured there: 1.67x / 2.75x / 3.18x);
- KV: 30 layers x 2 (k, v) x 3 KV heads x 64 head dim x 4 bytes (f32) = 46080 bytes per token
  (the default model; BENCHMARKS.md measures 46,080 B per slot too); capacity 30 streams x 8192
  tokens, what `shardline serve` budgets on this 24 GiB machine ("What the serving engine does
  with this": ~380 MB per stream at 8192 tokens, 30 streams);
- merge and drop: measured in real coupled runs on this machine (2026-12-01, 1-stage gguf, one
  thread): merging one joiner into 1-5 kept rows at ~900-1000 slots cost 0.2-1.2 s over the plain
  step, 0.12-0.55 GB/s of the merged state (0.25 GB/s typical); drops and compactions 1.6-3.9 GB/s;
- transfer: NOT measured yet. 2 ms fixed (reading and writing a stage's KV state at 512 tokens
  costs ~2-4 ms on CPU, MISSION.md facts) and 125e6 B/s (1 Gbit/s Ethernet between PCs: an
  assumption, the common consumer link).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from shardline.disagg.files import read_json, write_text_atomic
from shardline.errors import ShardlineError

FORMAT = "shardline-disagg-costs"
# 2: merge_bytes_per_s and drop_bytes_per_s; 3: prefill_knee_tokens. A file whose knee is off is
# still written as version 2 without that field, byte for byte what older readers read.
VERSION = 3
KNEE_SINCE = 3  # the version that added prefill_knee_tokens (absent, and so 0, in older files)
MAX_FILE_BYTES = 1 << 20  # a costs file is a few hundred bytes
DEFAULT_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (k, v) x KV heads x head dim x f32
DEFAULT_SOURCE = "rough figures from BENCHMARKS.md (costs.py docstring), not a calibration"

_FLOATS = ("prefill_base_s", "prefill_token_s", "prefill_token_ctx_s", "decode_base_s", "decode_row_s",
           "decode_row_ctx_s", "transfer_latency_s", "transfer_bytes_per_s", "merge_bytes_per_s", "drop_bytes_per_s")
_INTS = ("kv_bytes_per_token", "kv_tokens")


@dataclass(frozen=True)
class Costs:
    prefill_base_s: float = 0.0148
    prefill_token_s: float = 0.00124
    prefill_token_ctx_s: float = 1.6e-6
    decode_base_s: float = 0.0112
    decode_row_s: float = 0.0019
    decode_row_ctx_s: float = 3.2e-6
    transfer_latency_s: float = 0.002
    transfer_bytes_per_s: float = 125e6
    merge_bytes_per_s: float = 0.25e9
    drop_bytes_per_s: float = 2.5e9
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    kv_tokens: int = 30 * 8192
    source: str = DEFAULT_SOURCE  # where the figures came from: a table's readers need it
    prefill_knee_tokens: int = 0  # a chunk shorter than this costs as one this long; 0: no knee

    def __post_init__(self) -> None:
        for name in _FLOATS:
            v = getattr(self, name)
            if not _finite(v) or v < 0:
                raise ShardlineError(f"costs: {name} must be a finite number >= 0, got {v!r:.40}")
        for name in _INTS:
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ShardlineError(f"costs: {name} must be an integer >= 1, got {v!r:.40}")
        knee = self.prefill_knee_tokens
        if type(knee) is not int or knee < 0:
            raise ShardlineError(f"costs: prefill_knee_tokens must be an integer >= 0, got {knee!r:.40}")
        if not isinstance(self.source, str) or len(self.source) > 1000:
            raise ShardlineError("costs: source must be a string of at most 1000 characters")
        # Every step takes time: simulated time then advances with every step (no zero-time loop).
        if self.prefill_base_s + self.prefill_token_s <= 0 or self.decode_base_s + self.decode_row_s <= 0:
            raise ShardlineError("costs: a prefill chunk and a decode step must each cost some time")
        for name in ("transfer_bytes_per_s", "merge_bytes_per_s", "drop_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ShardlineError(f"costs: {name} must be > 0")

    def prefill_s(self, tokens: int, context: int) -> float:
        """A chunk of `tokens` positions (padding included) after `context` cached tokens; one
        below the knee costs as a chunk of the knee (module docstring)."""
        _counts("prefill", tokens, context)
        m = max(tokens, self.prefill_knee_tokens)
        return self.prefill_base_s + self.prefill_token_s * m + self.prefill_token_ctx_s * m * context

    def decode_s(self, rows: int, context: int) -> float:
        """A decode step of `rows` rows, each attending over `context` positions."""
        _counts("decode", rows, context)
        return self.decode_base_s + self.decode_row_s * rows + self.decode_row_ctx_s * rows * context

    def merge_s(self, rows: int, width: int) -> float:
        """What merging joiners adds to a step whose state ends with `rows` rows of `width` slots."""
        _counts("merge", rows, width)
        return self.kv_bytes(rows * width) / self.merge_bytes_per_s

    def drop_s(self, rows: int, width: int) -> float:
        """What dropping rows or compacting adds to a step over `rows` rows of `width` slots."""
        _counts("drop", rows, width)
        return self.kv_bytes(rows * width) / self.drop_bytes_per_s

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def transfer_s(self, nbytes: int) -> float:
        if nbytes < 0:
            raise ShardlineError(f"a transfer moves >= 0 bytes, got {nbytes}")
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    @classmethod
    def fit(cls, prefill: Sequence[tuple[int, int, float]], decode: Sequence[tuple[int, int, float]],
            transfer: Sequence[tuple[int, float]], merges: Sequence[tuple[int, float]] = (),
            drops: Sequence[tuple[int, float]] = (), kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
            kv_tokens: int = 30 * 8192, source: str = "") -> Costs:
        """Least squares, every coefficient >= 0, from measured samples: prefill chunks as
        (tokens, context, seconds), decode steps as (rows, context, seconds), transfers as
        (bytes, seconds), and what a merge or a drop adds to a step as (bytes of the state,
        seconds) (none given: the defaults stay). Each set must vary its inputs enough to tell
        its terms apart."""
        p = _fit("prefill", [(1.0, n, n * c) for n, c, _ in prefill], [s for *_, s in prefill])
        d = _fit("decode", [(1.0, r, r * c) for r, c, _ in decode], [s for *_, s in decode])
        t = _fit("transfer", [(1.0, b) for b, _ in transfer], [s for _, s in transfer])
        if t[1] <= 0:
            raise ShardlineError("costs fit: transfer time does not grow with bytes: no bandwidth to fit")
        rates = {name: _rate(name, samples) for name, samples in
                  (("merge_bytes_per_s", merges), ("drop_bytes_per_s", drops)) if samples}
        n = len(prefill) + len(decode) + len(transfer) + len(merges) + len(drops)
        return cls(**rates,
                   prefill_base_s=p[0], prefill_token_s=p[1], prefill_token_ctx_s=p[2],
                   decode_base_s=d[0], decode_row_s=d[1], decode_row_ctx_s=d[2],
                   transfer_latency_s=t[0], transfer_bytes_per_s=1.0 / t[1],
                   kv_bytes_per_token=kv_bytes_per_token, kv_tokens=kv_tokens,
                   prefill_knee_tokens=0,  # a linear fit has no knee (a CPU shows none)
                   source=source or f"least-squares fit of {n} measured samples")

    def to_json(self, path: Path) -> None:
        """Written atomically: a temporary file in the same folder, then renamed over `path`.
        Without a knee, as version 2 (no prefill_knee_tokens field), which older readers take."""
        body = asdict(self)
        version = VERSION if self.prefill_knee_tokens else KNEE_SINCE - 1
        if version < KNEE_SINCE:
            del body["prefill_knee_tokens"]
        doc = {"format": FORMAT, "version": version, **body}
        write_text_atomic(path, json.dumps(doc, indent=1) + "\n")

    @classmethod
    def from_json(cls, path: Path) -> Costs:
        doc = read_json(path, "costs file", MAX_FILE_BYTES)
        try:
            return cls(**_fields(doc))
        except ShardlineError as e:
            raise ShardlineError(f"costs file {path}: {e}") from None


def _counts(kind: str, n: int, context: int) -> None:
    if n < 1 or context < 0:
        raise ShardlineError(f"a {kind} step needs >= 1 tokens or rows and a context >= 0, got {n} and {context}")


def _finite(x: object) -> bool:
    """A number (not a bool) that is a finite float; an int too large for one is not."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _fields(doc: object) -> dict[str, Any]:
    """Exactly the Costs fields of the file's version, each present (values are checked by Costs
    itself); a version 2 file has no knee (its default, 0, applies)."""
    if not isinstance(doc, dict):
        raise ShardlineError("not a JSON object")
    version = doc.get("version")
    if doc.get("format") != FORMAT or type(version) is not int or version not in (KNEE_SINCE - 1, VERSION):
        raise ShardlineError(f"not a {FORMAT} file of version {KNEE_SINCE - 1} or {VERSION}")
    names = {f.name for f in fields(Costs)} - ({"prefill_knee_tokens"} if version < KNEE_SINCE else set())
    missing, extra = names - doc.keys(), doc.keys() - names - {"format", "version"}
    if missing or extra:
        raise ShardlineError(f"fields missing {sorted(missing)}, unknown {sorted(extra)[:5]}")
    return {n: doc[n] for n in names}


def _rate(name: str, samples: Sequence[tuple[int, float]]) -> float:
    """Bytes per second through the origin (seconds = bytes / rate), by least squares."""
    b, y = np.asarray([x for x, _ in samples], np.float64), np.asarray([x for _, x in samples], np.float64)
    if not np.isfinite(b).all() or not np.isfinite(y).all() or (b <= 0).any() or float(b @ y) <= 0:
        raise ShardlineError(f"costs fit: {name} needs samples of positive bytes and time that grows with them")
    return float(b @ b / (b @ y))


def _fit(kind: str, rows: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """min ||A x - y|| over x >= 0: ordinary least squares on every subset of the columns (the
    others held at 0), the best feasible one. Exact for these 2-3 terms, and no scipy needed."""
    a, y = np.asarray(rows, np.float64), np.asarray(seconds, np.float64)
    width = a.shape[1] if a.ndim == 2 else 0
    if len(rows) < width or not width or not np.isfinite(a).all() or not np.isfinite(y).all() or (y < 0).any():
        raise ShardlineError(f"costs fit: {kind} needs at least {width or 'a few'} samples of finite, "
                             f"non-negative numbers")
    if np.linalg.matrix_rank(a) < width:
        raise ShardlineError(f"costs fit: the {kind} samples do not vary enough to separate its {width} terms")
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, width + 1):
        for cols in combinations(range(width), k):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(width)
            full[list(cols)] = x
            residual = float(np.sum((a @ full - y) ** 2))
            if best is None or residual < best[0]:
                best = (residual, full)
    if best is None:
        raise ShardlineError(f"costs fit: no non-negative {kind} coefficients fit the samples")
    return tuple(float(v) for v in best[1])
