"""What comes back from a pipeline comes back one way (issue 41 point 5): steps' Outcomes and a
Moved for each watched KV move, in the order they happened; a caller's wake ends a wait and is
never taken as an outcome."""

from __future__ import annotations

import threading

import numpy as np

from shardline.errors import ShardlineError
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.plan import KvCopy, KvExport, Moved, Outcome


def test_a_watched_move_comes_out_once_it_lands() -> None:
    box = Outbox()
    copy, export = KvCopy(1, 2, np.arange(3)), KvExport(4)
    box.watch(copy)
    box.watch(export)
    assert box.take(0.0) == []  # neither has landed
    box.put(Outcome(7))
    copy.done.set_exception(ShardlineError("stage 1: no such key"))
    got = box.take(0.0)
    assert [type(o) for o in got] == [Outcome, Moved]
    moved = got[1]
    assert isinstance(moved, Moved) and moved.item is copy and moved.item.done.exception() is not None
    export.done.set_result(None)  # type: ignore[arg-type]
    (late,) = box.take(0.0)
    assert isinstance(late, Moved) and late.item is export


def test_a_move_that_landed_before_it_was_watched_still_comes_out() -> None:
    box = Outbox()
    copy = KvCopy(1, 2, np.arange(3))
    copy.done.set_result(None)
    box.watch(copy)
    (moved,) = box.take(0.0)
    assert isinstance(moved, Moved) and moved.item is copy


def test_a_wake_ends_the_wait_and_is_not_an_outcome() -> None:
    box = Outbox()
    threading.Timer(0.05, box.wake).start()
    assert box.take(None) == []  # no timeout: only the wake ends this wait
    box.wake()
    box.put(Outcome(3))
    assert box.take(0.0) == [Outcome(3)]
