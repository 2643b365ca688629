"""The runner kinds a stage may be exported for, by its manifest entry's `runner`: one place to
add a kind. "stateful" (StageRunner: the KV cache inside the compiled model's state; CPU, GPU)
is the only one today; a static, stateless runner with a host-managed KV ring is the next
(issue 25: NPUs reject dynamic shapes and stateful graphs). Every place that compiles a stage
opens it here, so a stage runs on its own device (RunConfig.for_stage) with its own kind.
"""

from __future__ import annotations

from pathlib import Path

import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.manifest import StageEntry
from shardline.stage.runner import StageRunner

RUNNERS: dict[str, type[StageRunner]] = {"stateful": StageRunner}


def open_stage(folder: Path, entry: StageEntry, run: RunConfig, core: ov.Core | None = None,
               vocab: int | None = None, context: int | None = None) -> StageRunner:
    """`entry` compiled by the runner its manifest names, on `run`'s (one) device."""
    kind = RUNNERS.get(entry.runner)
    if kind is None:
        raise ShardlineError(f"{entry.name} of {folder} needs a {entry.runner!r} runner; this shardline runs "
                             f"{', '.join(RUNNERS)} stages (a newer export?)")
    return kind(folder, entry, run, core, vocab, context)
