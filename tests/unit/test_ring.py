"""The host KV ring's policy (stage/static_runner.py), as plain arrays: within the ring a plan
slot is its own ring slot; past it the sinks stay and the other slots take turns."""

from __future__ import annotations

import numpy as np

from shardline.stage.static_runner import ring_holds, ring_slot


def test_within_the_ring_every_slot_is_its_own() -> None:
    assert ring_slot(np.arange(8), 8, None).tolist() == list(range(8))
    assert ring_slot(np.arange(8), 8, 2).tolist() == list(range(8))
    assert ring_holds(5, 8, 2).tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert ring_holds(8, 8, None).tolist() == list(range(8))


def test_past_the_ring_the_sinks_stay_and_the_tail_slides() -> None:
    # ring 8, sinks 2: plan slots 8, 9, ... overwrite ring slots 2, 3, ... (the oldest first)
    assert ring_slot(np.arange(6, 16), 8, 2).tolist() == [6, 7, 2, 3, 4, 5, 6, 7, 2, 3]
    assert ring_holds(9, 8, 2).tolist() == [0, 1, 8, 3, 4, 5, 6, 7]
    assert ring_holds(15, 8, 2).tolist() == [0, 1, 14, 9, 10, 11, 12, 13]
    for written in range(9, 40):  # every ring slot holds the latest plan slot mapped to it
        holds = ring_holds(written, 8, 2)
        latest = {int(r): p for p, r in enumerate(ring_slot(np.arange(written), 8, 2).tolist())}
        assert holds.tolist() == [latest[r] for r in range(8)]
        assert sorted(holds[2:].tolist()) == list(range(written - 6, written))  # the latest 6, the sinks apart
