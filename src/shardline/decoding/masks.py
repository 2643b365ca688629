"""Allowed tokens per sampled position: what constrained decoding (a grammar, a JSON schema) hands
the sampler on the last stage (issue 40). Pure numpy: workers apply masks, they never compute them.

Where the mask is computed: beside the engine, on the coordinator, which knows each stream's
tokens (decoding/grammar.py); each step then carries a compact bitmask per constrained sampled
entry (1 bit per token: 19 KB a position for a 151,936-token vocabulary) to whichever process
runs the last stage. The worker needs no grammar engine and no per-stream state, and a replay or
a move to another worker needs nothing resent. A verify step carries one mask per position: the
grammar's state after the drafts before it (a position's choice only counts when they all stood).

Layout: llguidance's, bit j of int32 word w allows token 32 * w + j (little-endian bit order).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardline.errors import Unsampleable

MAX_VOCAB = 1 << 20  # the widest vocabulary a mask may describe (bounds a frame's masks)


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


@dataclass(frozen=True)
class TokenMasks:
    """Per sampled entry of a step (the order of its `sample_at`): the row of `bits` that limits
    it, or -1 where the entry is free (rows with and without constraints share a step)."""

    bits: np.ndarray  # [M, W] i32
    which: np.ndarray  # [E] i64: -1 or a row of bits

    def __post_init__(self) -> None:
        check_masks(self.bits, self.which)

    def allowed(self, e: int, vocab: int) -> np.ndarray | None:
        """Entry `e`'s allowed tokens as booleans over a `vocab` of logits (None: unconstrained).
        Tokens past the mask's words are not allowed; a mask narrower than the vocabulary is
        refused by the step's check (stage/executor.py)."""
        m = int(self.which[e])
        if m < 0:
            return None
        bits = np.unpackbits(self.bits[m].view(np.uint8), bitorder="little")
        return bits[:vocab].astype(bool)


class LateMasks:
    """A step's masks, computed once by whoever needs them first. The engine asks right after
    handing the step to the pipeline (pipeline/plan.execute), so in process the grammar's work
    runs while the step's stages do; the last stage asks when it samples and a remote pipeline
    when it sends the step past its first stage, and either waits for the other. A step's
    streams have no other step in flight, so their grammar states cannot move in between."""

    def __init__(self, compute: Callable[[], TokenMasks | None]) -> None:
        self._compute: Callable[[], TokenMasks | None] | None = compute
        self._lock = threading.Lock()
        self._value: TokenMasks | None = None
        self._error: Exception | None = None

    def prepare(self) -> None:
        """Compute them now if no one has (what computing raises is kept for `get`)."""
        with self._lock:
            if self._compute is not None:
                compute, self._compute = self._compute, None
                try:
                    self._value = compute()
                except Exception as e:  # noqa: BLE001 - kept for whoever samples: the step's rows fail with it
                    self._error = e

    def get(self) -> TokenMasks | None:
        """The masks (None: no row constrained yet); raises what computing them raised."""
        self.prepare()
        if self._error is not None:
            raise self._error
        return self._value


def resolved(masks: TokenMasks | LateMasks | None) -> TokenMasks | None:
    return masks.get() if isinstance(masks, LateMasks) else masks


def check_masks(bits: np.ndarray, which: np.ndarray) -> None:
    """The shapes fit and every entry names a row that exists (raises ValueError)."""
    if bits.dtype != np.int32 or bits.ndim != 2 or which.dtype != np.int64 or which.ndim != 1:
        raise ValueError(f"token masks: bits {bits.dtype}{bits.shape}, which {which.dtype}{which.shape}")
    if bits.shape[1] > mask_words(MAX_VOCAB):
        raise ValueError(f"token masks of {bits.shape[1]} words: wider than a {MAX_VOCAB}-token vocabulary")
    if which.size and (int(which.min()) < -1 or int(which.max()) >= bits.shape[0]):
        raise ValueError(f"token masks: an entry names a mask outside 0-{bits.shape[0] - 1}")


def masked(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """`logits` with the tokens not allowed at -inf (a copy; the row itself when unconstrained)."""
    if allowed is None:
        return logits
    if not allowed.any():
        raise Unsampleable(1)
    return np.where(allowed, logits, np.float32(-np.inf))


class Constraint(Protocol):
    """A stream's grammar state, kept on the coordinator (model/grammar.py implements it)."""

    # Why this stream's grammar cannot go on (set where its masks are computed: a step's masks
    # for several streams never fail together, serving/constrained.py); None while it can.
    failure: str | None
    label: str  # what logs call it (never the whole grammar: a client's text)

    def masks(self, drafts: list[int]) -> np.ndarray | None:
        """[len(drafts) + 1, W] i32: what may follow the text so far, then after each draft
        (None: nothing is constrained yet, a lazy grammar waiting for its trigger)."""
        ...

    def valid(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows after the text so far."""
        ...

    def advance(self, token: int) -> None:
        """The stream emitted `token` (one the mask allowed)."""
        ...

    def ends(self, token: int) -> bool:
        """`token` ends the output: an end token where the grammar is complete."""
        ...
