"""The one stage executor: a `StageWork` (stage/work.py) through a run of stages.

Invariants:
- A step changes no stage's state before every check that can refuse it has passed (drafts
  outside the vocabulary, a merge that does not apply: StepRefused).
- Each stage prepares its state (open, merge or compact: stage/merge.py) just before running:
  a stage's state changes in exactly the order of its steps.
- Sampling happens on the last stage only, seeded by (seed, position): any process that runs
  the last stage draws the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from shardline.decoding.masks import LateMasks, TokenMasks, mask_words, resolved
from shardline.decoding.sampler import Choice, choose_at
from shardline.errors import StepRefused
from shardline.stage.cache import logits_index
from shardline.stage.merge import prepare
from shardline.stage.runners import Stage
from shardline.stage.work import StageWork


def run(stages: Sequence[Stage], work: StageWork, hidden: np.ndarray | None,
        graph_s: list[float], clock: Callable[[], float] = time.perf_counter) -> np.ndarray:
    """Prepare and run `stages` in order (stage 0 takes the input ids: `hidden` None); returns
    hidden states, or on the last stage the logits of the sampled positions. `graph_s` gets
    each stage's graph seconds. Raises StepRefused for a step that does not fit."""
    _check_drafts(stages[-1], work)
    if not isinstance(work.masks, LateMasks):  # late ones are checked when they come, at sampling
        _check_masks(work.masks, work, stages[-1].vocab if stages[-1].entry.has_head else None)
    compact, inputs = work.prepared()
    out = hidden
    for stage in stages:
        prepare(stage, work.key, first=work.first, keep=work.keep, merge=work.merge, compact=compact)
        step = inputs
        if stage.entry.has_head:
            step = replace(inputs, logits_index=logits_index(work.sample_at, inputs.rows)[0])
        start = clock()
        out = stage.run(work.key, step, out)
        graph_s.append(clock() - start)
    assert out is not None
    return out


def sample(work: StageWork, logits: np.ndarray) -> list[Choice]:
    """The last stage's choices: one per (row, t) of `sample_at`, in that order."""
    pick = logits_index(work.sample_at, work.inputs.rows)[1]
    masks = resolved(work.masks)
    if isinstance(work.masks, LateMasks):
        _check_masks(masks, work, int(logits.shape[-1]))
    return choose_at(logits, work.sample_at, pick, work.inputs.position_ids, list(work.sampling),
                     work.want_logits, work.drafted, masks)


def _check_drafts(last: Stage, work: StageWork) -> None:
    vocab = last.vocab if last.entry.has_head else None
    d = work.drafted
    if vocab and d is not None and d.q_ids.size and int(d.q_ids.max()) >= vocab:
        raise StepRefused(f"draft ids outside the vocabulary of {vocab}")


def _check_masks(m: TokenMasks | None, work: StageWork, vocab: int | None) -> None:
    """Masks are as wide as the vocabulary they limit, one entry per sampled position, and each
    allows some token. Masks that came with the step (a worker's, from the wire) are checked
    before any stage runs: a refused step changes no state. The coordinator's own late masks
    (LateMasks, in process) are checked when they come, before sampling."""
    if m is None:
        return
    if m.which.shape[0] != work.sample_at.shape[0]:
        raise StepRefused(f"{m.which.shape[0]} token masks for {work.sample_at.shape[0]} sampled positions")
    if vocab and m.bits.shape[0] and m.bits.shape[1] != mask_words(vocab):
        raise StepRefused(f"token masks of {m.bits.shape[1]} words for a vocabulary of {vocab}")
    if m.bits.shape[0] and not m.bits.any(axis=1).all():
        raise StepRefused("a token mask that allows no token")
