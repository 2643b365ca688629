"""A step as the Forward stage 0 sends down the chain, and a Sampled row back as a Choice."""

from __future__ import annotations

import time

import numpy as np

from shardline.decoding.masks import resolved
from shardline.decoding.sampler import Choice
from shardline.pipeline.plan import DecodeStep, PrefillStep, Step
from shardline.pipeline.ragged_step import RaggedStep
from shardline.wire.hops import no_hops, with_rows
from shardline.wire.messages import Forward, Ragged, Sampled, mask_to_runs


def forward(step: Step, seq: int, hidden: np.ndarray, graph_s: float, started: float) -> Forward:
    """`step` after stage 0 (its output `hidden`, in the activations' dtype; its graph took
    `graph_s` of the time since `started`), as the first worker takes it."""
    inputs = step.inputs
    keep, merge = (step.keep, step.merge) if isinstance(step, DecodeStep) else ((), ())
    hops = with_rows(no_hops(), [0], [graph_s], 0.0, time.perf_counter() - started - graph_s)
    compact = isinstance(step, DecodeStep) and step.compact
    d = step.drafted if isinstance(step, DecodeStep) else None
    m = resolved(step.masks)  # waits for the engine's, if it is computing them
    return Forward(step.key, seq, step.phase, isinstance(step, PrefillStep) and step.first,
                   int(inputs.attention_mask.shape[1]), step.want_logits, compact, list(step.sampling),
                   np.asarray(step.streams, np.int64), np.asarray(keep, np.int64), np.asarray(merge, np.int64),
                   hidden, mask_to_runs(inputs.attention_mask), inputs.position_ids, step.sample_at,
                   None if d is None else d.tokens, None if d is None else d.q_ids,
                   None if d is None else d.q_probs, None if m is None else m.bits, None if m is None else m.which,
                   hops)


def ragged(step: RaggedStep, seq: int, hidden: np.ndarray, graph_s: float, started: float) -> Ragged:
    """A paged `step` after stage 0 (its output `hidden` [T, H]), as the first worker takes it."""
    b, d, m = step.batch, step.drafted, resolved(step.masks)
    hops = with_rows(no_hops(), [0], [graph_s], 0.0, time.perf_counter() - started - graph_s)
    return Ragged(seq, step.phase, step.want_logits, list(step.sampling), np.asarray(step.streams, np.int64), hidden,
                  b.positions, b.past_lens, b.begins, b.block_indices, b.block_begins, step.sample_at,
                  None if d is None else d.tokens, None if d is None else d.q_ids, None if d is None else d.q_probs,
                  None if m is None else m.bits, None if m is None else m.which, hops)


def unknown_tokens(msg: Sampled, vocab: int) -> str | None:
    """Why the tokens of `msg` cannot be this model's (a worker's answer is checked like any frame:
    a token outside the vocabulary must not reach a detokenizer or a grammar), or None. A failed
    entry's token is -1."""
    ok = msg.tokens if msg.failed is None else msg.tokens[msg.failed < 0]
    if ok.size and (int(ok.min()) < 0 or int(ok.max()) >= vocab):
        return f"the last worker sent tokens outside the vocabulary of {vocab}"
    return None


def choice(msg: Sampled, e: int, top_n: int) -> Choice:
    """Entry `e` of `msg` (its top `top_n` alternatives, the padding of -1 ids left out)."""
    top: tuple[tuple[int, float], ...] = ()
    if top_n and msg.top_ids is not None and msg.top_logprobs is not None:
        ids, lps = msg.top_ids[e, :top_n].tolist(), msg.top_logprobs[e, :top_n].tolist()
        top = tuple((int(t), float(lp)) for t, lp in zip(ids, lps, strict=True) if t >= 0)
    logits = msg.logits[e] if msg.logits is not None else None
    failed = int(msg.failed[e]) if msg.failed is not None else -1
    return Choice(int(msg.tokens[e]), float(msg.logprobs[e]), top, logits, failed)
