"""What a serving engine can tell about its pipeline at any moment, for people (the fleet page,
api/fleet.py): where each run of stages is and whether it is up, the export's stage layers and
KV geometry, and the steps the pipeline observed lately. Each reading is lock-guarded or atomic:
any thread may call `pipeline_status`. /health's decision (`health`), and whether a round left
requests waiting with no step able to run (`stall`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardline.pipeline import metrics
from shardline.pipeline.plan import Placed, Plan
from shardline.pipeline.timing import Timing
from shardline.serving.kv_blocks import BlockCounts
from shardline.serving.stream import Stream

__all__ = ["Health", "PipelineStatus", "Placed", "Timing", "health", "hurry_repairs", "pipeline_status", "stall"]


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


@dataclass(frozen=True)
class Health:
    ok: bool  # the pipeline can serve: the engine runs and every stage of every chain is up
    reason: str  # why not ("" when ok)
    stages: list[dict[str, Any]]  # each stage run: instance, index, where, layers, state, why


def health(placements: dict[str, list[Placed]], failed: str | None, stalled: str | None = None) -> Health:
    """Pure: whether requests can be served now. A stage is down from the moment its link ends,
    it refuses, it answers no ping for the heartbeat window (a hung worker, idle or not) or a
    step outlives its deadline, until the chain is reopened. `stalled`: why no step can run
    while requests wait (`stall`), if so."""
    stages = [{"instance": name, "index": i, "where": p.where,
               "layers": [p.first_layer, p.last_layer] if p.first_layer >= 0 else None,
               "state": "up" if p.up else "down", "why": p.why}
              for name, chain in placements.items() for i, p in enumerate(chain)]
    if failed:
        return Health(False, f"the engine has stopped: {failed}", stages)
    if down := [s for s in stages if s["state"] == "down"]:
        first = down[0]
        where = f"{first['instance']} " if first["instance"] else ""
        return Health(False, f"{where}stage {first['index']} ({first['where']}) is down: {first['why']}", stages)
    if stalled:
        return Health(False, stalled, stages)
    return Health(True, "", stages)


def stall(plan: Plan, streams: Sequence[Stream], blocks: BlockCounts | None = None) -> str | None:
    """Pure: why no step can run while requests wait, read after a round (None: something runs,
    or nothing waits). The round planned nothing (no step, KV move or release), streams wait,
    and none has a step or a KV copy in flight: nothing can come back to change what the
    scheduler sees, and it plans from that alone, so every later round plans nothing too until
    a request ends or is cancelled. A state, not a timer's guess. `blocks`: a paged pool's."""
    if plan.steps or plan.exports or plan.imports or plan.copies or plan.releases or not streams:
        return None
    if any(s.in_flight or s.copying is not None for s in streams):
        return None
    prompts = sum(1 for s in streams if s.prefilling)
    held = f"; {blocks.held} of {blocks.held + blocks.cached + blocks.free} KV blocks held" if blocks else ""
    return f"no step can run: {len(streams)} streams waiting ({prompts} prompts), none in flight{held}"


def placements(engine: Any) -> dict[str, list[Placed]]:
    """Every chain the engine serves through ("" for a coupled engine's one)."""
    if (pipe := getattr(engine, "pipe", None)) is not None:
        return {"": pipe.placement()}
    return engine.placements() if hasattr(engine, "placements") else {}


def hurry_repairs(engine: Any) -> None:
    """Ask every broken chain the engine serves through to try to reopen now (a request waits)."""
    pipes = [engine.pipe] if getattr(engine, "pipe", None) is not None else \
        [e.pipe for e in engine.engines()] if hasattr(engine, "engines") else []
    for pipe in pipes:
        if (hurry := getattr(pipe, "hurry_repair", None)) is not None:
            hurry()
