"""The pages a person opens: the chat at `/`, the fleet at `/fleet` (static files, no build
step: api/static/), and the fleet page's JSON at `/fleet.json` (api/fleet.py). The pages call
the same API as any client; `/`, `/fleet` and `/fleet.json` need no key (as /health and
/metrics), the chat asks for one when /v1 answers 401 and keeps it in the browser."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from shardline.api.fleet import WINDOW_S, Readings, fleet_state
from shardline.config import KV_PRECISIONS
from shardline.model.context import kv_bytes_per_token
from shardline.serving.status import health, pipeline_status, placements

STATIC = Path(__file__).parent / "static"


def add_pages(app: FastAPI, served: Any, json_response: type[Response]) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def chat() -> Response:
        return FileResponse(STATIC / "chat.html")

    @app.get("/fleet", include_in_schema=False)
    async def fleet() -> Response:
        return FileResponse(STATIC / "fleet.html")

    @app.get("/fleet.json", include_in_schema=False)
    async def fleet_json() -> Response:
        return json_response(fleet_state(read(served)))


def read(served: Any) -> Readings:
    """The readings of this moment (any thread: each is a lock-guarded or atomic read)."""
    e = served.engine
    status = pipeline_status(e, WINDOW_S)
    running = e.speculating()
    ended = e.spec_ended
    kv = served.kv if served.kv in KV_PRECISIONS else "f32"
    now = health(placements(e), e.failed, e.stalled)
    per_layer = kv_bytes_per_token(1, status.kv_heads, status.head_dim, kv) if status else 0
    return Readings(
        model=served.model_id, precision=served.precision, weights=status.weights if status else "",
        status="ok" if now.ok else "unhealthy", error=now.reason, active_streams=e.active,
        waiting=e.waiting, max_streams=e.limits.max_streams, decode_groups=getattr(e, "groups_live", 0),
        placement=status.placement if status else [], stage_layers=status.stage_layers if status else [],
        steps=status.steps if status else [], now=time.monotonic(),
        drafted=ended.drafted + sum(s.drafted for s in running.values()),
        accepted=ended.accepted + sum(s.accepted for s in running.values()),
        rss_bytes=psutil.Process().memory_info().rss, kv_slots=getattr(e, "kv_slots_live", 0),
        kv_token_bytes_per_layer=per_layer, kv_bytes=getattr(e, "kv_bytes_live", None))
