"""The last paged stage's choices (issue 41), pure over its logits: one per sampled entry, the
same draw wherever the stage runs (in the coordinator's process or on a worker). Entry e is
(sequence, t) of `sample_at`; logits row e is its row, and a drafted entry is verified against
the draft's distribution. Randomness is from (seed, position), as on every path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.masks import LateMasks, TokenMasks, mask_words, resolved
from shardline.decoding.sampler import Choice, entry
from shardline.decoding.speculative import Drafted
from shardline.errors import StepRefused
from shardline.stage.paged_batch import PagedBatch


def choices(batch: PagedBatch, sample_at: np.ndarray, sampling: Sequence[SamplingParams], logits: np.ndarray,
            want_logits: bool, masks: TokenMasks | LateMasks | None, drafted: Drafted | None) -> list[Choice]:
    """A choice per entry of `sample_at`: the token at the position after the sampled one (a
    failed Choice where none can be chosen: that entry's stream fails alone)."""
    if not sample_at.size:
        return []
    if logits.ndim != 2 or logits.shape[0] != sample_at.shape[0]:
        raise StepRefused(f"logits {logits.shape} for {sample_at.shape[0]} sampled entries")
    m = resolved(masks)
    if m is not None and (m.which.shape[0] != logits.shape[0] or
                          (m.bits.shape[0] and m.bits.shape[1] != mask_words(int(logits.shape[1])))):
        raise StepRefused(f"token masks do not fit {logits.shape[0]} entries of a vocabulary of {logits.shape[1]}")
    out = []
    for e, (q, t) in enumerate(sample_at.tolist()):
        position = int(batch.positions[int(batch.begins[q]) + t]) + 1
        out.append(entry(logits[e], sampling[q], position, e, want_logits, drafted, m))
    return out


def logits_rows(begins: Sequence[int] | np.ndarray, sample_at: np.ndarray) -> list[int]:
    """The batch positions whose logits the last stage computes (`begins`: where each sequence
    starts): one per sampled entry, or the first token's when nothing samples (the head's graph
    needs a row; it is dropped)."""
    return [int(begins[q]) + t for q, t in sample_at.tolist()] or [0]
