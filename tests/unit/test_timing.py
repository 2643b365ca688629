"""The per-token breakdown from the rows each hop appends: attribution and the wire remainder."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.pipeline.timing import breakdown
from shardline.wire.hops import DECODE, ENCODE, GRAPH, HOST, STAGE, no_hops, with_rows
from shardline.wire.messages import HOP_COLUMNS, RELAY


def test_columns_match_the_wire_layout() -> None:
    assert [HOP_COLUMNS[i] for i in (STAGE, GRAPH, DECODE, HOST, ENCODE)] == \
        ["stage", "graph_s", "decode_s", "host_s", "encode_s"]
    assert HOP_COLUMNS[-1] == "encode_s"  # the codec stamps the last f64 of the frame


def test_a_process_with_two_stages_puts_its_own_figures_on_its_last_row() -> None:
    hops = with_rows(no_hops(), [0], [0.007], 0.0, 0.0003)
    hops[-1, ENCODE] = 0.00002  # as the codec would stamp it
    hops = with_rows(hops, [1, 2], [0.006, 0.008], 0.00005, 0.0004)
    assert hops.tolist() == [[0, 0.007, 0, 0.0003, 0.00002],
                             [1, 0.006, 0, 0, 0],
                             [2, 0.008, 0.00005, 0.0004, 0]]


def test_breakdown_attributes_every_row_and_leaves_the_wire_as_remainder() -> None:
    hops = np.array([
        [0, 0.020, 0.0, 0.001, 0.0001],       # coordinator: stage 0
        [1, 0.022, 0.0002, 0.0005, 0.0001],   # worker: stage 1
        [RELAY, 0.0, 0.0002, 0.0001, 0.0001],  # star: the coordinator relays
        [2, 0.010, 0.0003, 0.0006, 0.00005],  # worker: stage 2, sampled
    ])
    t = breakdown("decode", hops, back_decode_s=0.0001, back_host_s=0.0002, total_s=0.060)
    assert t.graph_s == pytest.approx({0: 0.020, 1: 0.022, 2: 0.010})
    assert t.encode_s == pytest.approx(0.00035)
    assert t.decode_s == pytest.approx(0.0008)
    assert t.coordinator_host_s == pytest.approx(0.0013)  # stage 0 row + relay row + after the token
    assert t.worker_host_s == pytest.approx(0.0011)
    assert t.wire_s == pytest.approx(0.060 - 0.052 - 0.00035 - 0.0008 - 0.0013 - 0.0011)
    assert sum(t.parts().values()) == pytest.approx(t.total_s)
    assert list(t.parts())[:3] == ["graph stage 0", "graph stage 1", "graph stage 2"]
