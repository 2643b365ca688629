"""One Forward through a worker's stages: the same plan every stage of the chain applies.

The worker keeps no speculation, sampling or group logic of its own: the Forward says which key,
whether it is the key's first step, which rows to keep and which streams to merge (or whether
to compact), the mask and positions, and which positions to sample with which settings (and
which drafts, drawn from which distributions, to verify there). Keys are those of one session
(one coordinator's chain): `scope` turns the coordinator's key into the stages' key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from shardline.decoding.masks import TokenMasks, mask_words
from shardline.decoding.sampler import Choice
from shardline.decoding.speculative import Drafted
from shardline.stage import executor as stage_work
from shardline.stage.cache import StepInputs
from shardline.stage.runners import Stage
from shardline.stage.work import StageWork
from shardline.wire.messages import Forward, Sampled, runs_to_mask

Scope = Callable[[int], Hashable]


def work_of(msg: Forward, scope: Scope) -> StageWork:
    """What the worker's stages do for a Forward: the mask from its runs; rows dropped by
    `keep` (when nothing is merged) through the graph's beam_idx; keys scoped to the session."""
    b = msg.hidden.shape[0]
    beam = msg.keep.astype(np.int32) if msg.keep.size and not msg.merge.size else None
    inputs = StepInputs(np.zeros((b, 0), np.int64), runs_to_mask(msg.mask_runs, b, msg.slots), msg.position_ids, beam)
    drafted = None
    if msg.drafts is not None and msg.q_ids is not None and msg.q_probs is not None:
        drafted = Drafted(msg.drafts, msg.q_ids, msg.q_probs)
    masks = None if msg.allow_bits is None or msg.allow_of is None else TokenMasks(msg.allow_bits, msg.allow_of)
    return StageWork(scope(msg.key), inputs, msg.sample_at, msg.sampling, first=msg.first,
                     keep=msg.keep.tolist(), merge=[scope(int(m)) for m in msg.merge], compact=msg.compact,
                     want_logits=msg.want_logits, drafted=drafted, masks=masks)


def run_stages(stages: list[Stage], work: StageWork, msg: Forward,
               graph_s: list[float], clock: Callable[[], float]) -> np.ndarray:
    """Every stage of the worker in order (raises StepRefused for a step that does not fit);
    returns hidden states, or on the last stage the logits of the sampled positions."""
    return stage_work.run(stages, work, msg.hidden.astype(np.float32, copy=False), graph_s, clock)


def sampled(msg: Forward, work: StageWork, logits: np.ndarray, hops: Callable[[], np.ndarray]) -> Sampled:
    """The last stage's answer: a choice for every (row, t) of `sample_at`, in that order
    (`hops` is called once the choices are made, so the worker's host time includes them)."""
    choices = stage_work.sample(work, logits)
    top_ids, top_lp = tops(choices, max((p.top_logprobs for p in msg.sampling), default=0))
    logits_out = np.stack([c.logits for c in choices if c.logits is not None]) if msg.want_logits and choices \
        else None
    return Sampled(msg.key, msg.seq, np.array([c.token for c in choices], np.int64),
                   np.array([c.logprob for c in choices], np.float32), top_ids, top_lp, logits_out,
                   failures(choices), hops())


def masks_refusal(bits: np.ndarray | None, vocab: int) -> str | None:
    """Why a step's token masks cannot limit this model's tokens (None: they can, or it has none):
    checked by every worker as the step comes, not only by the last one that applies them, so a
    step a later stage would refuse goes no further."""
    if bits is None or not bits.shape[0]:
        return None
    if bits.shape[1] != mask_words(vocab):
        return f"token masks of {bits.shape[1]} words for a vocabulary of {vocab}"
    if not bits.any(axis=1).all():
        return "a token mask that allows no token"
    return None


def failures(choices: list[Choice]) -> np.ndarray | None:
    """Per entry -1 or why no token was chosen (wire Sampled.failed); None when all were."""
    if all(c.failed < 0 for c in choices):
        return None
    return np.array([c.failed for c in choices], np.int32)


def tops(choices: list[Choice], n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Every choice's alternatives in [E, n] arrays, padded with -1 / -inf."""
    if not n:
        return None, None
    ids = np.full((len(choices), n), -1, np.int64)
    lps = np.full((len(choices), n), -np.inf, np.float32)
    for e, c in enumerate(choices):
        for j, (t, lp) in enumerate(c.top[:n]):
            ids[e, j], lps[e, j] = t, lp
    return ids, lps
