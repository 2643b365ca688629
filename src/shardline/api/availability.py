"""A request that arrives while a chain is down is never sent into it: it waits for the chain's
repair (hurried along) within the reconnect window, else gets a 503 with Retry-After, as a load
balancer expects of a node that is out for a while. An engine that has stopped is left to
generation.check_alive (its own 503, no retry)."""

from __future__ import annotations

import asyncio
from typing import Any

from shardline.api.schemas import ApiError
from shardline.serving.status import health, hurry_repairs, placements

POLL_S = 0.2  # how often a waiting request looks again
DOWN_RETRY_AFTER_S = 5  # a broken chain is retried every few seconds (pipeline/life.py REPAIR_MAX_S)


async def when_up(engine: Any, window_s: float) -> None:
    """Return once every stage is up (at once, as a rule); ApiError 503 after `window_s`."""
    if getattr(engine, "failed", None):
        return
    now = health(placements(engine), None)
    if now.ok:
        return
    loop = asyncio.get_running_loop()
    until = loop.time() + window_s
    while True:
        hurry_repairs(engine)
        await asyncio.sleep(POLL_S)
        now = health(placements(engine), None)
        if now.ok:
            return
        if loop.time() >= until:
            raise ApiError(503, f"the pipeline is down, retry later: {now.reason}", "server_error",
                           code="pipeline_unavailable", headers={"Retry-After": str(DOWN_RETRY_AFTER_S)})
