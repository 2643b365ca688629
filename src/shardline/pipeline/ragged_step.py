"""One step of a paged pipeline (issue 41): every sequence's new tokens end to end in one flat
batch, decode tokens and prompt chunks fused, each sequence over its own block table, and the
positions whose next token is wanted. A third kind of plan item beside PrefillStep and
DecodeStep (pipeline/plan.py): it names no key, since the KV's blocks are in the batch.

Invariants: one sequence per stream, in the order of `streams`; `sample_at` holds (sequence, t)
pairs in that order (a verify step's sequence asks after each of its tokens), and
`batch.logits_at` the same positions flattened, so the last stage's logits row e is the one
entry e samples from (and `drafted`'s entry e, if any, is verified against).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.masks import LateMasks, TokenMasks
from shardline.decoding.sampler import Choice
from shardline.decoding.speculative import Drafted
from shardline.errors import ShardlineError
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.paged_sample import choices, logits_rows
from shardline.wire.messages import Phase


@dataclass(frozen=True)
class Part:
    """One stream's part of a ragged step: its new tokens over its block table."""

    stream: int
    tokens: tuple[int, ...]
    past: int  # tokens its blocks hold already
    blocks: tuple[int, ...]
    sampling: SamplingParams
    sample: bool  # its last new token's next token is wanted (a decode step, a prompt's last chunk)
    prompt: bool  # a prompt chunk (else decode tokens)
    every: bool = False  # the next token after each new token is wanted (a verify step: its drafts)


@dataclass(frozen=True)
class RaggedStep:
    streams: tuple[int, ...]  # the stream of each sequence
    sampling: tuple[SamplingParams, ...]  # per sequence
    ids: np.ndarray  # [T] i64: every new token, sequence after sequence
    batch: PagedBatch
    sample_at: np.ndarray  # [E, 2] i64: (sequence, t) whose next token is wanted
    prompt_tokens: int  # of the T, those of prompt chunks (the rest decode)
    want_logits: bool = False
    masks: TokenMasks | LateMasks | None = None  # per sampled entry (constrained streams only)
    drafted: Drafted | None = None  # drafts drawn from distributions, per sampled entry
    prompts: tuple[bool, ...] = ()  # per sequence: a prompt chunk (what a summarizing stage 0 summarizes)
    made: float = field(default_factory=time.perf_counter, compare=False)
    kind: ClassVar[str] = "ragged"

    @staticmethod
    def of(seqs: list[Part], want_logits: bool = False, masks: TokenMasks | LateMasks | None = None,
           drafted: Drafted | None = None) -> RaggedStep:
        if not seqs or any(not s.tokens for s in seqs):
            raise ShardlineError("a ragged step needs sequences, each with a new token")
        at = np.array([[q, t] for q, s in enumerate(seqs) if s.sample
                       for t in (range(len(s.tokens)) if s.every else [len(s.tokens) - 1])], np.int64).reshape(-1, 2)
        begins = np.cumsum([0] + [len(s.tokens) for s in seqs])
        batch = PagedBatch.of([(len(s.tokens), s.past, s.blocks) for s in seqs], logits_at=logits_rows(begins, at))
        ids = np.array([t for s in seqs for t in s.tokens], np.int64)
        prompt = sum(len(s.tokens) for s in seqs if s.prompt)
        if drafted is not None and drafted.tokens.shape[0] != at.shape[0]:
            raise ShardlineError(f"{drafted.tokens.shape[0]} drafted entries for {at.shape[0]} sampled ones")
        return RaggedStep(tuple(s.stream for s in seqs), tuple(s.sampling for s in seqs), ids, batch, at, prompt,
                          want_logits, masks, drafted, tuple(s.prompt for s in seqs))

    @property
    def phase(self) -> Phase:
        """Prefill when it carries prompt tokens (its cost is mostly theirs), else decode."""
        return Phase.PREFILL if self.prompt_tokens else Phase.DECODE

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


def sample(step: RaggedStep, logits: np.ndarray) -> list[Choice]:
    """The last stage's choices, one per entry of `sample_at` (stage/paged_sample.py)."""
    return choices(step.batch, step.sample_at, step.sampling, logits, step.want_logits, step.masks, step.drafted)
