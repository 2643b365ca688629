"""One step as every stage executes it: the single stage executor (issue 24).

A step reaches a stage in one of three ways: a local stage thread takes the scheduler's
PrefillStep/DecodeStep (pipeline/local.py), stage 0 on the coordinator takes the same before
sending it down a chain (pipeline/remote.py), and a worker takes a Forward off its link
(node/execute.py). Each turns it into a `StageWork` and runs it with stage/executor.py, so what
a stage does (prepare its state, pick the logits' positions, run, sample) is written once. This
module is pure (no OpenVINO): the plans that carry work are made without a device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.masks import LateMasks, TokenMasks
from shardline.decoding.speculative import Drafted
from shardline.stage.cache import StepInputs


@dataclass(frozen=True)
class StageWork:
    """What every stage of a chain does for one step. `key` is the state's key as the stages
    hold it (a worker scopes the coordinator's key by session); `inputs` are as planned, over
    the cache as it is before any compaction (stages after the first ignore its input ids)."""

    key: Hashable
    inputs: StepInputs
    sample_at: np.ndarray  # [E, 2] i64: (row, t) whose next token is wanted
    sampling: Sequence[SamplingParams]  # per row
    first: bool = False  # opens a fresh state (a stream's first prompt chunk)
    keep: Sequence[int] = ()  # rows of the key's state kept (empty: all)
    merge: Sequence[Hashable] = ()  # keys whose one-row states join as rows after the kept ones
    compact: bool = False  # drop the slots the mask never attends again, then run
    want_logits: bool = False
    drafted: Drafted | None = None  # drafts drawn from distributions, per sampled entry
    masks: TokenMasks | LateMasks | None = None  # allowed tokens per sampled entry (constrained decoding)

    def prepared(self) -> tuple[tuple[np.ndarray, int] | None, StepInputs]:
        """What each stage compacts before this step (None: nothing) and the inputs it runs."""
        if not self.compact:
            return None, self.inputs
        index, inputs = self.inputs.compacted()
        return (index, self.inputs.attention_mask.shape[1] - self.inputs.new_tokens), inputs
