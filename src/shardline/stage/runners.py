"""The runner kinds a stage may be exported for, by its manifest entry's `runner`: one place to
add a kind. "stateful" (StageRunner: the KV cache inside the compiled model's state; CPU, GPU)
and "static" (StaticRunner: fixed shapes, the KV in a ring on the host; for NPUs, which reject
dynamic shapes and stateful graphs). Every place that compiles a stage opens it here, so a
stage runs on its own device (RunConfig.for_stage) with its own kind.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Protocol

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.model.manifest import StageEntry, StageLimits
from shardline.stage.cache import StepInputs
from shardline.stage.runner import StageRunner
from shardline.stage.static_runner import StaticRunner


class Stage(Protocol):
    """What the executor, merges, KV moves and workers use of a compiled stage, whatever its kind:
    its states by key, and steps run over them (StageRunner documents each)."""

    entry: StageEntry
    vocab: int | None
    hidden: int | None  # the width of the hidden states it takes (None: stage 0 takes ids)

    def limits(self) -> StageLimits: ...  # what it takes in one call (its manifest entry's)
    def open(self, key: Hashable) -> None: ...
    def has(self, key: Hashable) -> bool: ...
    def keys(self) -> list[Hashable]: ...
    def close(self, key: Hashable) -> None: ...
    def reset(self, key: Hashable) -> None: ...
    def move(self, key: Hashable, to: Hashable) -> None: ...
    def slots(self, key: Hashable) -> int: ...
    def rows(self, key: Hashable) -> int: ...
    def kv_layout(self) -> dict[str, tuple[np.dtype, int, int]]: ...
    def kv(self, key: Hashable, start: int = 0) -> dict[str, np.ndarray]: ...
    def set_kv(self, key: Hashable, kv: dict[str, np.ndarray]) -> None: ...
    def compact(self, key: Hashable, index: np.ndarray, slots: int) -> None: ...
    def run(self, key: Hashable, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray: ...


Open = Callable[[Path, StageEntry, RunConfig, "ov.Core | None", "int | None", "int | None"], Stage]
RUNNERS: dict[str, Open] = {"stateful": StageRunner, "static": StaticRunner}


def open_stage(folder: Path, entry: StageEntry, run: RunConfig, core: ov.Core | None = None,
               vocab: int | None = None, context: int | None = None) -> Stage:
    """`entry` compiled by the runner its manifest names, on `run`'s (one) device."""
    kind = RUNNERS.get(entry.runner)
    if kind is None:
        raise ShardlineError(f"{entry.name} of {folder} needs a {entry.runner!r} runner; this shardline runs "
                             f"{', '.join(RUNNERS)} stages (a newer export?)")
    return kind(folder, entry, run, core, vocab, context)


def copy_kv(stage: Stage, src: Hashable, dst: Hashable, row: int, index: np.ndarray) -> None:
    """Open `dst` with the slots `index` (in order) of row `row` of `src`'s state, or leave the
    stage as it was: StepRefused for a source it does not hold, a row or slot it lacks, or `dst`
    already open (prefix reuse: pipeline/plan.py KvCopy)."""
    rows, slots = stage.rows(src), stage.slots(src)
    if not 0 <= row < rows or index.ndim != 1 or not index.size or int(index.min()) < 0 or int(index.max()) >= slots:
        raise StepRefused(f"slots {_span(index)} of row {row} of a state of {rows} rows of {slots} slots")
    part = {n: np.ascontiguousarray(a[row : row + 1][:, :, index]) for n, a in stage.kv(src).items()}
    stage.open(dst)  # refuses a key already open: a live key is never overwritten (nor closed below)
    try:
        stage.set_kv(dst, part)
    except BaseException:
        stage.close(dst)
        raise


def _span(index: np.ndarray) -> str:
    return f"{int(index.min())}-{int(index.max())}" if index.size else "(none)"
