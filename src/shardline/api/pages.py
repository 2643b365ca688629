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
from shardline.pipeline import metrics
from shardline.pipeline.plan import Placed
from shardline.serving.admission import kv_bytes_per_token

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
    pipe = getattr(e, "pipe", None)  # a disaggregated front has several pipelines: not drawn yet
    placement: list[Placed] = pipe.placement() if pipe is not None else []
    manifest = getattr(pipe, "manifest", None)
    running = e.speculating()
    ended = e.spec_ended
    return Readings(
        model=served.model_id, precision=served.precision, weights=manifest.weights if manifest else "",
        status="unhealthy" if e.failed else "ok", error=e.failed or "", active_streams=e.active,
        waiting=e.waiting, max_streams=e.limits.max_streams, decode_groups=getattr(e, "groups_live", 0),
        placement=placement,
        stage_layers=[(s.first_layer, s.last_layer) for s in manifest.stages] if manifest else [],
        steps=metrics.recent(WINDOW_S), now=time.monotonic(),
        drafted=ended.drafted + sum(s.drafted for s in running.values()),
        accepted=ended.accepted + sum(s.accepted for s in running.values()),
        rss_bytes=psutil.Process().memory_info().rss, kv_slots=getattr(e, "kv_slots_live", 0),
        kv_token_bytes_per_layer=kv_bytes_per_token(1, manifest.arch.n_kv_heads, manifest.arch.head_dim,
                                                    4 if served.precision == "exact" else 1) if manifest else 0)
