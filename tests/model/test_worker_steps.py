"""A worker's step handling, in process (no sockets): a session's first step opens its key, a
step that does not fit fails alone with StepFailed, two sessions' keys never meet, and a
coordinator that goes away frees what its session held."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.node.session import Ended, Received, Session
from shardline.node.worker import StageWorker
from shardline.wire.hops import no_hops
from shardline.wire.messages import Forward, Message, Phase, Release, Sampled, StepFailed, mask_to_runs


class Recorder:
    """Stands in for a Link: records what the worker sends on it."""

    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.sent: list[Message] = []
        self.closed = False

    def send(self, msg: Message, stamp: bool = False) -> None:  # Link.send's signature
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


def _forward(key: int, slots: int, t: int, first: bool = False, width: int = 576, seed: int = 0,
             merge: tuple[int, ...] = (), keep: tuple[int, ...] = ()) -> Forward:
    b = max(1, len(keep) + len(merge))
    hidden = np.random.default_rng(seed).standard_normal((b, t, width)).astype(np.float16)
    mask = np.ones((b, slots + t), np.int64)
    return Forward(key, 0, Phase.PREFILL if first else Phase.DECODE, first, slots + t, False, False,
                   [SamplingParams()] * b,
                   np.arange(key, key + b, dtype=np.int64), np.asarray(keep, np.int64), np.asarray(merge, np.int64),
                   hidden, mask_to_runs(mask), np.tile(np.arange(slots, slots + t, dtype=np.int64), (b, 1)),
                   np.array([[r, t - 1] for r in range(b)], np.int64), None, None, None, None, None, no_hops())


@pytest.fixture(scope="module")
def worker(shards: Callable[..., Path]) -> StageWorker:
    return StageWorker(shards("fp32", stages=2), 1, 1)


def _session(worker: StageWorker, no: int) -> tuple[Session, Recorder]:
    link = Recorder(f"coordinator-{no}")
    session = Session(f"{no:032x}", no, link, routed=True)  # type: ignore[arg-type]
    worker.sessions[session.id] = session
    return session, link


def _send(worker: StageWorker, session: Session, msg: Message, link: Any = None) -> Message:
    coordinator: Any = session.coordinator
    before = len(coordinator.sent)
    worker._handle(Received(link or coordinator, session, msg, 0.0, 0.0))
    return coordinator.sent[before] if len(coordinator.sent) > before else None  # type: ignore[no-any-return]


def test_first_step_opens_and_bad_steps_fail_alone(worker: StageWorker) -> None:
    s, _ = _session(worker, 1)
    assert isinstance(_send(worker, s, _forward(5, 0, 3, first=True)), Sampled)
    assert isinstance(_send(worker, s, _forward(5, 3, 1)), Sampled)
    cases = {
        "unknown key 9": _forward(9, 3, 1),  # never opened
        "a mask of 5 slots for a cache of 4 plus 2": _forward(5, 3, 2),  # the cache has 4 slots
        "hidden states of shape (1, 1, 100)": _forward(5, 4, 1, width=100),
        "cannot merge": _forward(-1, 4, 1, merge=(5, 77)),  # stream 77 does not exist
        "cannot compact 5: 1 rows of 4 slots, a mask of 8 slots": replace(_forward(5, 8, 1), compact=True),
        "draft ids outside the vocabulary of 49152": replace(
            _forward(5, 4, 1), sampling=[SamplingParams(temperature=1.0)], drafts=np.array([70000]),
            q_ids=np.array([[70000]]), q_probs=np.array([[1.0]], np.float32)),
        "token masks of 3 words for a vocabulary of 49152": replace(
            _forward(5, 4, 1), allow_bits=np.full((1, 3), -1, np.int32), allow_of=np.array([0])),
        "a token mask that allows no token": replace(
            _forward(5, 4, 1), allow_bits=np.zeros((1, 1536), np.int32), allow_of=np.array([0])),
    }
    for why, msg in cases.items():
        reply = _send(worker, s, msg)
        assert isinstance(reply, StepFailed) and why in reply.reason, (why, reply)
    assert isinstance(_send(worker, s, _forward(5, 4, 1)), Sampled)  # the stream goes on
    one = np.zeros((1, 1536), np.int32)
    one[0, 100 // 32] = 1 << (100 % 32)  # token 100 alone
    reply = _send(worker, s, replace(_forward(5, 5, 1), allow_bits=one, allow_of=np.array([0])))
    assert isinstance(reply, Sampled) and reply.tokens.tolist() == [100]  # the worker applies the mask
    worker._handle(Ended(s))


def test_two_sessions_never_see_each_others_keys(worker: StageWorker) -> None:
    a, _ = _session(worker, 2)
    b, _ = _session(worker, 3)
    first_a = _send(worker, a, _forward(5, 0, 3, first=True, seed=1))
    first_b = _send(worker, b, _forward(5, 0, 6, first=True, seed=2))  # the same key, another chain
    assert isinstance(first_a, Sampled) and isinstance(first_b, Sampled)
    assert isinstance(_send(worker, a, _forward(5, 3, 1)), Sampled)  # a's cache still has 3 slots
    assert isinstance(_send(worker, b, _forward(5, 6, 1)), Sampled)
    assert sorted(worker.stages[0].keys()) == [(2, 5), (3, 5)]  # type: ignore[type-var]
    worker._handle(Ended(a))  # a's coordinator went away: only a's keys go
    assert worker.stages[0].keys() == [(3, 5)] and a.id not in worker.sessions
    assert isinstance(_send(worker, b, Release(5)), type(None))
    assert worker.stages[0].keys() == []
    worker._handle(Ended(b))


def test_a_release_or_a_step_for_another_session_does_nothing_to_it(worker: StageWorker) -> None:
    a, _ = _session(worker, 4)
    b, _ = _session(worker, 5)
    _send(worker, a, _forward(5, 0, 3, first=True))
    _send(worker, b, Release(5))  # b has no key 5: a's stays
    assert worker.stages[0].keys() == [(4, 5)]
    reply = _send(worker, b, _forward(5, 3, 1))
    assert isinstance(reply, StepFailed) and "unknown key" in reply.reason
    stranger = Recorder("upstream")
    _send(worker, a, Release(5), link=stranger)  # a Release only counts from the session's coordinator
    assert worker.stages[0].keys() == [(4, 5)] and stranger.closed
    worker._handle(Ended(a))
    worker._handle(Ended(b))
    assert worker.stages[0].keys() == []
