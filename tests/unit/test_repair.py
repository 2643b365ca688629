"""Reopening a chain within a window: attempts that fail fast are retried, one that never answers
(a stopped worker) is abandoned at the window's end and what it opens later is discarded."""

from __future__ import annotations

import threading
import time

import pytest

from shardline.errors import ShardlineError
from shardline.pipeline.repair import reopen


def test_attempts_are_retried_until_one_succeeds() -> None:
    calls: list[int] = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ShardlineError("cannot reach worker 127.0.0.1:9: Connection refused")
        return "links"

    assert reopen(attempt, window_s=5.0, discard=lambda _: None, pause_s=0.01) == "links"
    assert len(calls) == 3


def test_attempts_that_keep_failing_give_the_last_reason_after_the_window() -> None:
    start = time.monotonic()
    with pytest.raises(ShardlineError, match=r"^reconnecting for 0.3 s failed: cannot reach worker 127.0.0.1:9$"):
        reopen(lambda: (_ for _ in ()).throw(ShardlineError("cannot reach worker 127.0.0.1:9")), 0.3,
               lambda _: None, pause_s=0.05)
    assert 0.19 < time.monotonic() - start < 1.0


def test_an_attempt_that_never_answers_is_abandoned_and_its_result_discarded() -> None:
    answer, discarded = threading.Event(), list[str]()

    def hangs() -> str:
        answer.wait(10)  # a stopped worker: the handshake waits until it is continued
        return "late links"

    start = time.monotonic()
    with pytest.raises(ShardlineError, match=r"^reconnecting for 0.4 s failed: no answer within 0.4 s$"):
        reopen(hangs, 0.4, discarded.append, pause_s=0.01)
    assert time.monotonic() - start < 1.0
    answer.set()  # the worker continues: what the abandoned attempt opened is closed, not used
    deadline = time.monotonic() + 5
    while not discarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert discarded == ["late links"]


def test_an_unexpected_error_is_a_failed_attempt_with_its_type() -> None:
    def broken() -> str:
        raise OSError("network is unreachable")

    with pytest.raises(ShardlineError, match=r"failed: OSError: network is unreachable$"):
        reopen(broken, 0.05, lambda _: None, pause_s=0.01)
