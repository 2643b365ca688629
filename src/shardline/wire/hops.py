"""Per-hop durations that travel inside Forward and Sampled (layout: messages.HOP_COLUMNS).
Every process that runs a step appends its rows; pipeline/timing.py reads them back."""

from __future__ import annotations

import numpy as np

from shardline.wire.messages import HOP_COLUMNS

STAGE, GRAPH, DECODE, HOST, ENCODE = range(len(HOP_COLUMNS))


def no_hops() -> np.ndarray:
    return np.zeros((0, len(HOP_COLUMNS)), np.float64)


def with_rows(hops: np.ndarray, stages: list[int], graph_s: list[float], decode_s: float,
              host_s: float) -> np.ndarray:
    """`hops` plus one row per stage this process ran. Decode and host belong to the process and
    go on its last row; encode stays 0 there until the codec stamps it (Link.send(stamp=True))."""
    rows = np.zeros((len(stages), len(HOP_COLUMNS)), np.float64)
    rows[:, STAGE] = stages
    rows[:, GRAPH] = graph_s
    rows[-1, DECODE] = decode_s
    rows[-1, HOST] = host_s
    return np.concatenate([hops, rows])
