"""Stop sequences are checked on the engine thread, where stop tokens are: the stream ends in
the step whose token completed one, with finish "stop", and no token after it reaches the
caller. Over FakeChain (tests/unit/test_engine_replay.py), whose tokens are a pure function of
the text so far."""

from __future__ import annotations

import threading

import pytest

from shardline.config import SamplingConfig
from shardline.errors import ShardlineError
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from tests.unit.test_engine_replay import FakeChain


class _Digits:
    """Token t reads as its last digit: the text is easy to cut anywhere."""

    def push(self, token: int) -> str:
        return str(token % 10)


def _run(engine: Engine, request: Request) -> list[Event]:
    events: list[Event] = []
    done = threading.Event()

    def on(ev: Event) -> None:
        events.append(ev)
        if ev.finish:
            done.set()

    engine.submit(request, on)
    assert done.wait(10)
    return events


def test_a_stop_sequence_ends_the_stream_in_the_engine() -> None:
    engine = Engine(FakeChain(), Limits(2, 2), 4096, SchedulerConfig(chunk=8, groups=0))
    try:
        plain = _run(engine, Request([5, 6, 7], SamplingConfig(max_tokens=12), frozenset(), detokenizer=_Digits))
        text = "".join(ev.text for ev in plain)
        assert plain[-1].finish == "length" and len(text) == 12  # every token's digit, held text flushed
        stop = text[5:7]
        first = text.index(stop)
        stopped = _run(engine, Request([5, 6, 7], SamplingConfig(max_tokens=12), frozenset(), stops=(stop,),
                                       detokenizer=_Digits))
    finally:
        engine.stop()
    tokens = [ev for ev in stopped if ev.token is not None]
    assert [ev.token for ev in tokens] == [ev.token for ev in plain[: first + 2]]  # none after the stop
    assert tokens[-1].cut and not any(ev.cut for ev in tokens[:-1])
    assert "".join(ev.text for ev in stopped) == text[:first]  # the stop itself is never shown
    assert [ev.offset for ev in tokens] == list(range(first + 2))
    assert stopped[-1].finish == "stop" and stopped[-1].token is None
    assert engine.active == 0


def test_stop_sequences_without_a_detokenizer_are_refused() -> None:
    engine = Engine(FakeChain(), Limits(2, 2), 4096, SchedulerConfig(chunk=8, groups=0))
    try:
        with pytest.raises(ShardlineError, match="stop sequences need the request's detokenizer"):
            engine.submit(Request([5, 6], SamplingConfig(max_tokens=4), frozenset(), stops=("x",)), lambda ev: None)
    finally:
        engine.stop()
