"""What the fleet page shows (`GET /fleet.json`): the chain and the last seconds of its work.

Read at request time from what the server measures anyway: the pipeline's placement (where
each run of stages is, and whether it is up), the engine's streams and decode groups, the
steps the pipeline observed lately (pipeline/metrics.py: graph time per stage, wire time,
rows), speculation's counts and this process's memory. `fleet_state` is a pure function of
those readings (`Readings`), so what the page says is tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.serving.status import Placed, Timing

WINDOW_S = 10.0  # "recent": the steps of the last ten seconds


@dataclass(frozen=True)
class Readings:
    model: str
    precision: str  # this process's run precision (workers report only their weights)
    weights: str  # the export's weights, every stage's
    status: str  # "ok" or "unhealthy"
    error: str
    active_streams: int
    waiting: int
    max_streams: int
    decode_groups: int
    placement: list[Placed]
    stage_layers: list[tuple[int, int]]  # the export's stages (a worker may run several)
    steps: list[tuple[float, Timing, int]]  # (monotonic time, timing, rows) of the last WINDOW_S
    now: float  # monotonic
    drafted: int
    accepted: int
    rss_bytes: int  # this process
    kv_slots: int = 0  # the KV slots the streams hold, on every stage
    kv_token_bytes_per_layer: int = 0  # one token's keys and values in one layer, as this process keeps them
    kv_bytes: int | None = None  # measured instead: the KV held over every stage (a paged pool's blocks held)


def fleet_state(r: Readings) -> dict[str, Any]:
    decode = [(t, timing, rows) for t, timing, rows in r.steps if timing.phase == "decode"]
    span = max(1e-9, min(WINDOW_S, r.now - decode[0][0])) if decode else WINDOW_S
    tokens = sum(rows for _, _, rows in decode)
    stages = [_stage(i, p, r, decode, tokens) for i, p in enumerate(r.placement)]
    hops = max(1, len(r.placement) - 1) if len(r.placement) > 1 else 0
    wire = [max(0.0, timing.wire_s) for _, timing, _ in decode]
    return {
        "model": r.model, "status": r.status, "error": r.error,
        "streams": {"active": r.active_streams, "waiting": r.waiting, "max": r.max_streams,
                    "decode_groups": r.decode_groups},
        "tokens_per_s": round(tokens / span, 2) if decode else 0.0,
        "stages": stages,
        # Wire time is measured per step over every hop (timing.py); a hop's share is its mean.
        "hops": [{"from": i, "to": i + 1, "wire_ms": _ms(sum(wire) / len(wire) / hops) if wire else None}
                 for i in range(hops)],
        "prefill": _prefill(r.steps, bool(decode)),
        "speculation": {"drafted": r.drafted, "accepted": r.accepted,
                        "acceptance": round(r.accepted / r.drafted, 3) if r.drafted else None},
        "memory_mb": round(r.rss_bytes / 2**20, 1),
        "window_s": WINDOW_S,
    }


def _stage(i: int, p: Placed, r: Readings, decode: list[tuple[float, Timing, int]], tokens: int) -> dict[str, Any]:
    here = p.where == "this process"
    mine = [k for k, (a, b) in enumerate(r.stage_layers) if p.first_layer <= a and b <= p.last_layer]
    graph = sum(timing.graph_s.get(k, 0.0) for _, timing, _ in decode for k in mine)
    layers = p.last_layer - p.first_layer + 1 if p.first_layer >= 0 else 0
    return {"index": i, "where": p.where, "device": p.device or None,
            "layers": [p.first_layer, p.last_layer] if p.first_layer >= 0 else None,
            "precision": f"{r.weights}, {r.precision}" if here else r.weights,
            "health": "up" if p.up else "down", "why": p.why,
            "graph_ms_per_token": _ms(graph / tokens) if tokens else None,
            "kv_mb": round(_kv_bytes(r, layers) / 2**20, 2)}


def _kv_bytes(r: Readings, layers: int) -> float:
    """The streams' KV on `layers` of the model's layers: a paged pool's blocks held shared by
    layer (every layer's block is alike), else their slots at this process's KV dtype (a
    worker's may differ)."""
    if r.kv_bytes is not None:
        total = sum(b - a + 1 for a, b in r.stage_layers)
        return r.kv_bytes * layers / total if total else 0.0
    return r.kv_slots * layers * r.kv_token_bytes_per_layer


HOLDING = 0.5  # prefill's share of the graph time past which it holds running streams back


def _prefill(steps: list[tuple[float, Timing, int]], decoding: bool) -> dict[str, Any]:
    """Prefill's share of the stages' graph time in the window, and whether it holds decoding
    streams back (more than half of the time went to prompts while streams decoded)."""
    by_phase = {"prefill": 0.0, "decode": 0.0}
    for _, timing, _ in steps:
        by_phase[timing.phase] = by_phase.get(timing.phase, 0.0) + sum(timing.graph_s.values())
    total = by_phase["prefill"] + by_phase["decode"]
    share = by_phase["prefill"] / total if total else 0.0
    return {"share": round(share, 3), "holding_decode": decoding and share > HOLDING,
            "prefill_s": round(by_phase["prefill"], 3), "decode_s": round(by_phase["decode"], 3)}


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)
