"""The per-token breakdown as Prometheus histograms, on the default registry (the HTTP server
serves it at /metrics).

prometheus-client comes with the `serve` extra: without it `observe` does nothing, so running
shards still needs only openvino and numpy. Only the coordinator observes: every hop's durations
come back to it with the token (timing.py), and workers stay free of metrics.

    shardline_stage_graph_seconds{stage, phase}      time inside one stage's graph
    shardline_codec_seconds{op=encode|decode, phase}  all frames of one step, every process
    shardline_wire_seconds{phase}                    one step's time on the wire, all hops
    shardline_worker_host_seconds{phase}             workers' other work (queueing, sampling)
    shardline_coordinator_host_seconds{phase}        the coordinator's other work
    shardline_step_seconds{phase}                    the coordinator's round trip of one step

Besides, the last steps are kept (`recent`, with or without prometheus-client) for figures of
the last few seconds: the fleet page's graph time per token and tokens per second (api/fleet.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from shardline.pipeline.timing import Timing

# 10 us to 10 s: a codec call is tens of microseconds, a long prefill seconds.
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0)
_lock = threading.Lock()
RECENT_STEPS = 4096  # bounded whatever the rate: a few seconds of the busiest serving
_recent: deque[tuple[float, Timing, int]] = deque(maxlen=RECENT_STEPS)  # (monotonic time, timing, rows)
_histograms: dict[str, Any] | None = None
_unavailable = False


def _get() -> dict[str, Any] | None:
    """The histograms, registered once per process (a second registration would raise)."""
    global _histograms, _unavailable
    with _lock:
        if _histograms is None and not _unavailable:
            try:
                from prometheus_client import Histogram
            except ImportError:
                _unavailable = True
                return None

            def h(name: str, doc: str, *labels: str) -> Any:
                return Histogram(f"shardline_{name}_seconds", doc, [*labels, "phase"], buckets=BUCKETS)

            _histograms = {
                "graph": h("stage_graph", "time inside one stage's graph per step", "stage"),
                "codec": h("codec", "encode or decode of all frames of one step, every process", "op"),
                "wire": h("wire", "one step's time on the wire: round trip minus everything measured"),
                "worker_host": h("worker_host", "workers' work besides graph and codec, queueing included"),
                "coordinator_host": h("coordinator_host", "the coordinator's work besides stage 0 and codec"),
                "step": h("step", "the coordinator's round trip of one step"),
            }
        return _histograms


def recent(window_s: float) -> list[tuple[float, Timing, int]]:
    """The steps observed in the last `window_s` seconds: (when, timing, rows), oldest first."""
    since = time.monotonic() - window_s
    with _lock:
        return [x for x in _recent if x[0] >= since]


def observe(t: Timing, rows: int = 1) -> None:
    """One step of `rows` streams done (each got at least one token if it sampled)."""
    with _lock:
        _recent.append((time.monotonic(), t, rows))
    m = _get()
    if m is None:
        return
    for stage, seconds in t.graph_s.items():
        m["graph"].labels(stage=str(stage), phase=t.phase).observe(seconds)
    m["codec"].labels(op="encode", phase=t.phase).observe(t.encode_s)
    m["codec"].labels(op="decode", phase=t.phase).observe(t.decode_s)
    # Wire is a remainder and can come out a few microseconds below 0 on a quiet loopback.
    m["wire"].labels(phase=t.phase).observe(max(t.wire_s, 0.0))
    m["worker_host"].labels(phase=t.phase).observe(t.worker_host_s)
    m["coordinator_host"].labels(phase=t.phase).observe(t.coordinator_host_s)
    m["step"].labels(phase=t.phase).observe(t.total_s)
