"""What a serving engine can tell about its pipeline at any moment, for people (the fleet page,
api/fleet.py): where each run of stages is and whether it is up, the export's stage layers and
KV geometry, and the steps the pipeline observed lately. Each reading is lock-guarded or atomic:
any thread may call `pipeline_status`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.pipeline import metrics
from shardline.pipeline.plan import Placed
from shardline.pipeline.timing import Timing

__all__ = ["PipelineStatus", "Placed", "Timing", "pipeline_status"]


@dataclass(frozen=True)
class PipelineStatus:
    placement: list[Placed]  # in chain order, from stage 0
    stage_layers: list[tuple[int, int]]  # the export's stages (a worker may run several)
    weights: str
    kv_heads: int
    head_dim: int
    steps: list[tuple[float, Timing, int]]  # (monotonic time, timing, rows) of the last `window_s`


def pipeline_status(engine: Any, window_s: float) -> PipelineStatus | None:
    """None for a front of several pipelines (disaggregated serving): no one chain to draw."""
    pipe = getattr(engine, "pipe", None)
    manifest = getattr(pipe, "manifest", None)
    if pipe is None or manifest is None:
        return None
    return PipelineStatus(pipe.placement(), [(s.first_layer, s.last_layer) for s in manifest.stages],
                          manifest.weights, manifest.arch.n_kv_heads, manifest.arch.head_dim,
                          metrics.recent(window_s))
