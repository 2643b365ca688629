"""What a frame may make a worker hold (node/bounds.py), on a real worker in process: the audit's
KV copy (slot 0 16,384 times) is refused before anything is allocated, and over any sequence of
frames of every message kind the KV it holds stays within 1 x the frames' bytes plus one row at
the bound (context + SLACK_SLOTS) per frame."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.config import RunConfig, SamplingParams
from shardline.node.bounds import SLACK_SLOTS
from shardline.node.session import Ended, Session
from shardline.node.worker import StageWorker
from shardline.stage.runners import Stage
from shardline.wire.codec import encode
from shardline.wire.hops import no_hops
from shardline.wire.messages import (
    MESSAGES,
    PROTOCOL,
    Activations,
    Forward,
    Hello,
    KvCopy,
    KvDone,
    KvPart,
    KvPull,
    KvPush,
    Message,
    Phase,
    Ping,
    Pong,
    Refuse,
    Release,
    Role,
    Route,
    Sampled,
    ShardChunk,
    ShardRequest,
    StepFailed,
    mask_to_runs,
)
from tests.model.test_paged_worker import _step as ragged
from tests.model.test_worker_steps import Recorder, _send, _session

CONTEXT = 48
WIDTH = 576  # the default model's hidden size
BOUND = CONTEXT + SLACK_SLOTS


@pytest.fixture(scope="module")
def worker(shards: Callable[..., Path]) -> StageWorker:
    w = StageWorker(shards("fp32", stages=2), 1, 1, RunConfig(context=CONTEXT))
    assert w.hello is not None and w.hello.context == CONTEXT
    return w


def slot_bytes(worker: StageWorker) -> int:
    """Bytes of one slot of one row over every KV variable of the worker's stages."""
    return sum(heads * dim * np.dtype(dtype).itemsize for s in worker.stages
               for dtype, heads, dim in s.kv_layout().values())


def keys_of(stage: Stage) -> list[Any]:
    return stage.keys()  # noqa: SIM118 - a Stage, not a dict


def held(worker: StageWorker, session: Session) -> int:
    """The KV the worker's stages hold, plus a push's parts kept until its last."""
    kv = sum(s.rows(k) * s.slots(k) * sum(h * d * np.dtype(t).itemsize for t, h, d in s.kv_layout().values())
             for s in worker.stages for k in keys_of(s))
    parts = sum(a.nbytes for kept in session.push.arrays for a in kept.values()) if session.push else 0
    return kv + parts


def forward(key: int, slots: int, t: int, *, first: bool = False, rows: int = 1, keep: tuple[int, ...] = (),
            merge: tuple[int, ...] = (), start: int | None = None) -> Forward:
    """A step of `rows` rows of `t` new tokens over a mask of `slots` + t slots."""
    hidden = np.random.default_rng(key & 0xFFFF).standard_normal((rows, t, WIDTH)).astype(np.float16)
    at = slots if start is None else start
    return Forward(key, 0, Phase.PREFILL if first else Phase.DECODE, first, slots + t, False, False,
                   [SamplingParams()] * rows, np.arange(rows, dtype=np.int64) + 1000, np.asarray(keep, np.int64),
                   np.asarray(merge, np.int64), hidden, mask_to_runs(np.ones((rows, slots + t), np.int64)),
                   np.tile(np.arange(at, at + t, dtype=np.int64), (rows, 1)),
                   np.array([[r, t - 1] for r in range(rows)], np.int64), None, None, None, None, None, no_hops())


def parts_for(worker: StageWorker, seq: int, slots: int) -> list[KvPart]:
    stage = worker.stages[0]
    return [KvPart(seq, stage.entry.first_layer, stage.entry.last_layer, name,
                   np.zeros((1, heads, slots, dim), dtype)) for name, (dtype, heads, dim)
            in sorted(stage.kv_layout().items())]


def test_the_audits_copy_of_slot_0_16384_times_is_refused_and_holds_nothing(worker: StageWorker) -> None:
    session, link = _session(worker, 71)
    try:
        assert isinstance(_send(worker, session, forward(4, 0, 4, first=True)), Sampled)
        before = held(worker, session)
        # The frame as the audit sent it is refused by the codec (messages.KvCopy: increasing).
        with pytest.raises(ValueError, match="KvCopy.index: slots not strictly increasing"):
            KvCopy(1, 4, 5, 0, np.zeros(16384, np.int64))
        # Distinct and increasing but past the context: refused by the worker before any copy.
        done = _send(worker, session, KvCopy(2, 4, 5, 0, np.arange(CONTEXT + 1, dtype=np.int64)))
        assert isinstance(done, KvDone) and done.error == (
            f"KvCopy.index: {CONTEXT + 1} slots; a copy holds at most the context of {CONTEXT}")
        assert held(worker, session) == before and not any(s.has((session.no, 5)) for s in worker.stages)
        ok = _send(worker, session, KvCopy(3, 4, 5, 0, np.arange(4, dtype=np.int64)))
        assert isinstance(ok, KvDone) and ok.error == ""
    finally:
        worker._handle(Ended(session))


def test_a_step_or_push_wider_than_a_row_may_be_fails_alone(worker: StageWorker) -> None:
    session, link = _session(worker, 72)
    try:
        failed = _send(worker, session, forward(6, BOUND, 1, first=False))
        assert isinstance(failed, StepFailed) and failed.reason.startswith(
            f"Forward.slots: a mask of {BOUND + 1} slots; a row holds at most {BOUND} here")
        _send(worker, session, KvPush(9, 7, 1, BOUND + 1, len(parts_for(worker, 9, 0))))
        done = [_send(worker, session, p) for p in parts_for(worker, 9, 1)][-1]
        assert isinstance(done, KvDone) and done.error.startswith(f"key 7: KvPush.slots: {BOUND + 1} slots")
        assert session.push is None and held(worker, session) == 0
        assert isinstance(_send(worker, session, forward(6, 0, 3, first=True)), Sampled)  # the link goes on
    finally:
        worker._handle(Ended(session))


def test_a_key_grows_by_steps_only_to_its_bound(worker: StageWorker) -> None:
    """Positions may repeat (the runner checks only that each is inside the context), so without
    a bound on the width a key would grow by a context's worth of slots per frame for ever."""
    session, link = _session(worker, 74)
    try:
        assert isinstance(_send(worker, session, forward(8, 0, CONTEXT, first=True, start=0)), Sampled)
        slots = CONTEXT
        while slots + CONTEXT <= BOUND:
            assert isinstance(_send(worker, session, forward(8, slots, CONTEXT, start=0)), Sampled)
            slots += CONTEXT
        failed = _send(worker, session, forward(8, slots, CONTEXT, start=0))
        assert isinstance(failed, StepFailed)
        assert failed.reason.startswith(f"Forward.slots: a mask of {slots + CONTEXT}")
        assert all(s.slots((session.no, 8)) == slots for s in worker.stages)
    finally:
        worker._handle(Ended(session))


def test_a_key_opens_with_one_row() -> None:
    with pytest.raises(ValueError, match="Forward.rows: a key's first step opens one row, not 2"):
        forward(3, 0, 2, first=True, rows=2)
    with pytest.raises(ValueError, match="a push opens one row"):
        KvPush(1, 3, 2, 4, 1)


# --- the property: every message kind, any order -----------------------------------------------

def _others() -> list[Message]:
    hello = Hello(PROTOCOL, Role.COORDINATOR, "h", 0, 0, "fp32", Activations.F16, "0" * 32, CONTEXT)
    return [hello, Refuse("no"), StepFailed(1, 2, "x"), Sampled(1, 2, np.zeros(1, np.int64), np.zeros(1, np.float32),
            None, None, None, None, no_hops()), ShardRequest("a.bin"), ShardChunk("a.bin", 0, 1, "0" * 64,
            np.zeros(1, np.uint8)), Route(""), KvDone(1, 0, ""), KvPull(1, 3), Release(3), Ping(1), Pong(1),
            ragged([(3, 0, [0]), (1, 40, [1, 2])])]  # a paged step: this stateful worker refuses it


@st.composite
def frame(draw: Any, worker: StageWorker, session: Session) -> list[Message]:
    """One message (a push with its parts) of any kind, often hostile, against the keys open now."""
    open_keys = [k[1] for k in keys_of(worker.stages[0]) if k[0] == session.no]
    keys = st.sampled_from(open_keys) if open_keys else st.integers(-3, 8)
    kind = draw(st.sampled_from(["first", "step", "merge", "push", "copy", "other"]))
    slots = draw(st.integers(0, BOUND + 40))
    if kind == "first":
        return [forward(draw(st.integers(-3, 8)), 0, draw(st.integers(1, 12)), first=True)]
    if kind == "step":
        key = draw(keys)
        have = worker.stages[0].slots((session.no, key)) if key in open_keys else 0
        rows = worker.stages[0].rows((session.no, key)) if key in open_keys else 1
        return [forward(key, draw(st.sampled_from([have, slots])), draw(st.integers(1, 240)), rows=max(rows, 1),
                        start=draw(st.integers(0, CONTEXT + 4)))]
    if kind == "merge":
        joiners = draw(st.lists(keys, min_size=1, max_size=4, unique=True))
        group = draw(st.integers(-6, -4))
        keep = tuple(draw(st.lists(st.integers(0, 3), max_size=3, unique=True)))
        return [forward(group, max(slots, 0), 1, rows=len(keep) + len(joiners), keep=keep, merge=tuple(joiners))]
    if kind == "push":
        seq = draw(st.integers(0, 99))
        parts = parts_for(worker, seq, slots)
        return [KvPush(seq, draw(st.integers(-3, 12)), 1, slots, len(parts)), *parts]
    if kind == "copy":
        src = draw(keys)
        index = sorted(draw(st.sets(st.integers(0, max(slots, 1)), min_size=1, max_size=CONTEXT + 8)))
        dst = draw(st.integers(9, 14).filter(lambda d: d != src))  # into itself: the codec refuses it
        return [KvCopy(draw(st.integers(0, 99)), src, dst, draw(st.integers(0, 2)), np.asarray(index, np.int64))]
    return [draw(st.sampled_from(_others()))]


def test_every_message_kind_is_in_the_property() -> None:
    made = {type(m) for m in _others()} | {Forward, KvPush, KvPart, KvCopy}
    assert made == set(MESSAGES.values())


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_a_worker_holds_is_bounded_by_what_it_was_sent(worker: StageWorker, data: Any) -> None:
    session, link = _session(worker, 73)
    sent_bytes, accepted = 0, 0
    one_row = BOUND * slot_bytes(worker)
    try:
        for _ in range(data.draw(st.integers(1, 12))):
            for msg in data.draw(frame(worker, session)):
                sent_bytes += len(encode(msg))
                accepted += 1
                _send(worker, session, msg)
                if isinstance(link, Recorder):
                    link.closed = False  # a refused kind closes the link: here the next frame comes anyway
                assert held(worker, session) <= sent_bytes + accepted * one_row
                assert all(s.slots(k) <= BOUND for s in worker.stages for k in keys_of(s))
                assert sum(worker.stages[0].rows(k) for k in keys_of(worker.stages[0])) <= accepted  # one row a frame
        assert isinstance(_send(worker, session, forward(99, 0, 2, first=True)), Sampled)  # it still serves
    finally:
        worker._handle(Ended(session))
