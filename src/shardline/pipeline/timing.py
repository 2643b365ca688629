"""Per-token breakdown: where one step's round trip went, from the durations each hop appended.

Every process appends its rows to the step's `hops` array (layout: wire/messages.py
HOP_COLUMNS) and the coordinator, once the token is back, takes out of its own round trip
everything that was measured. Only durations travel, each measured on one process's clock, so
the machines' clocks never need to agree. What is left is the wire's share: socket writes and
reads, the kernel, a relay's delay, and a woken thread waiting for a core all count as wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardline.wire.hops import DECODE, ENCODE, GRAPH, HOST, STAGE


@dataclass(frozen=True)
class Timing:
    """One step of one stream, in seconds. The parts add up to `total_s` by construction (wire is
    the remainder); whether they are right is what tests/multiproc/test_breakdown.py checks."""

    phase: str  # "prefill" | "decode"
    total_s: float  # the coordinator's round trip: submit() called -> outcome ready
    graph_s: dict[int, float]  # stage index -> time inside that stage's graph
    encode_s: float  # every frame of the step, on every process
    decode_s: float
    worker_host_s: float  # workers' own work besides graph and codec (queueing, sampling, casts)
    coordinator_host_s: float  # the coordinator's, besides stage 0's graph and its codec
    wire_s: float

    def parts(self) -> dict[str, float]:
        """Named parts in table order; they sum to total_s."""
        graphs = {f"graph stage {k}": v for k, v in sorted(self.graph_s.items())}
        return graphs | {"encode": self.encode_s, "decode": self.decode_s, "worker host": self.worker_host_s,
                         "coordinator host": self.coordinator_host_s, "wire": self.wire_s}


def breakdown(phase: str, hops: np.ndarray, back_decode_s: float, back_host_s: float, total_s: float) -> Timing:
    """The breakdown of a step whose token came back with `hops`. `back_decode_s` is the
    coordinator's decode of that last frame and `back_host_s` its work after it. Rows of stage 0
    (run by the coordinator) and relay rows (stage < 0, a star's coordinator) count as coordinator."""
    coordinator = hops[:, STAGE] <= 0
    graph: dict[int, float] = {}
    for stage, g in zip(hops[:, STAGE].astype(int), hops[:, GRAPH], strict=True):
        if stage >= 0:
            graph[int(stage)] = graph.get(int(stage), 0.0) + float(g)
    encode = float(hops[:, ENCODE].sum())
    decode = float(hops[:, DECODE].sum()) + back_decode_s
    coord_host = float(hops[coordinator, HOST].sum()) + back_host_s
    worker_host = float(hops[~coordinator, HOST].sum())
    wire = total_s - sum(graph.values()) - encode - decode - coord_host - worker_host
    return Timing(phase, total_s, graph, encode, decode, worker_host, coord_host, wire)
