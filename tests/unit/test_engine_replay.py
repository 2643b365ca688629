"""The engine replays the streams a pipeline lost, over a fake pipeline whose every token depends
on the whole context its key holds and on the position: a replay that fed other tokens, at other
positions, or emitted a token twice, gives another answer than the run without faults."""

from __future__ import annotations

import threading
from collections.abc import Callable

from shardline.config import SamplingConfig
from shardline.decoding.sampler import Choice
from shardline.pipeline.inflight import Outbox
from shardline.pipeline.plan import DecodeStep, Outcome, PrefillStep, Step
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request, Ticket
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig

LOST = "lost worker 127.0.0.1:7002: 127.0.0.1:7002 closed the connection"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def _token(context: list[int], position: int) -> int:
    return 100 + (sum((i + 1) * t for i, t in enumerate(context)) + 7 * position) % 97


class FakeChain:
    """Steps run at once on submit. A step `lose` picks is lost, and every key's state with it, as
    when a chain breaks; a later step that needs a state it no longer holds is lost too (as
    RemotePipeline does), until a stream's first chunk opens one afresh."""

    n_stages = 3
    context = 4096

    def __init__(self, lose: Callable[[Step], bool] = lambda _: False) -> None:
        self.state: dict[int, list[list[int]]] = {}  # key -> each row's tokens so far
        self.outbox = Outbox()
        self.lose = lose

    def submit(self, step: Step) -> None:
        try:
            if self.lose(step):
                raise KeyError(step.key)
            choices = self._run(step)
        except KeyError:
            self.state.clear()
            for s in step.streams:
                self.outbox.put(Outcome(s, error=LOST, lost=True))
            return
        for r, s in enumerate(step.streams):
            self.outbox.put(Outcome(s, tuple(c for c, row in choices if row == r)))

    def _run(self, step: Step) -> list[tuple[Choice, int]]:
        if isinstance(step, PrefillStep) and step.first:
            rows: list[list[int]] = [[]]
        elif isinstance(step, DecodeStep) and (step.merge or step.keep):
            rows = [self.state[step.key][i] for i in step.keep] + [self.state.pop(m)[0] for m in step.merge]
        else:
            rows = self.state[step.key]
        self.state[step.key] = rows
        ids, pos = step.inputs.input_ids.tolist(), step.inputs.position_ids.tolist()
        out = [(Choice(_token(rows[r] + ids[r][: t + 1], pos[r][t]), 0.0), r) for r, t in step.sample_at.tolist()]
        for r, row in enumerate(rows):
            row += ids[r]
        return out

    def release(self, key: int) -> None:
        self.state.pop(key, None)

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        return self.outbox.take(timeout)

    def wake(self) -> None:
        self.outbox.wake()

    def idle(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _serve(pipe: FakeChain, replays: Replays | None = None,
           n: int = 12) -> tuple[list[list[Event]], Engine, list[Ticket]]:
    engine = Engine(pipe, Limits(4, 4), 4096, SchedulerConfig(chunk=4, groups=1), None, replays)
    events: list[list[Event]] = [[] for _ in PROMPTS]
    done = threading.Semaphore(0)

    def on(i: int) -> Callable[[Event], None]:
        def event(ev: Event) -> None:
            events[i].append(ev)
            if ev.finish:
                done.release()
        return event

    tickets = [engine.submit(Request(p, SamplingConfig(max_tokens=n), frozenset()), on(i))
               for i, p in enumerate(PROMPTS)]
    try:
        for _ in PROMPTS:
            assert done.acquire(timeout=10)
    finally:
        engine.stop()
    return events, engine, tickets


def _tokens(events: list[Event]) -> list[int]:
    assert events[-1].finish == "length", events[-1]
    return [e.token for e in events if e.token is not None]


def test_streams_lost_in_prefill_and_in_a_group_give_the_answer_of_a_run_without_faults() -> None:
    clean, _, _ = _serve(FakeChain())
    want = [_tokens(e) for e in clean]
    assert all(len(w) == 12 for w in want)
    # the second prompt's first chunk (the first prompt's state goes too: its next chunk is
    # lost), then the third step of the group once both streams decode in it
    seen = {"first": 0, "group": 0}

    def lose(step: Step) -> bool:
        if isinstance(step, PrefillStep) and step.first and step.inputs.input_ids[0, 0] == PROMPTS[1][0]:
            seen["first"] += 1
            return seen["first"] == 1
        if isinstance(step, DecodeStep) and step.inputs.rows == 2:
            seen["group"] += 1
            return seen["group"] == 3
        return False

    pipe = FakeChain(lose)
    got, _, tickets = _serve(pipe)
    assert [_tokens(e) for e in got] == want  # nothing emitted twice, nothing missing
    streams = [t.stream for t in tickets if t.stream is not None]
    assert [s.replays for s in streams] == [2, 2]
    assert all(s.resumed >= 2 for s in streams)  # the second replay came mid-generation
    assert pipe.state == {}  # every key released: the streams', the old ones' and the group's


def test_a_pipeline_that_is_never_repaired_ends_the_request_with_why() -> None:
    got, engine, _ = _serve(FakeChain(lambda _: True), Replays(most=2, within_s=30.0))
    for events in got:
        (final,) = events
        assert final.finish == "error"
        assert final.error == f"the pipeline broke under this request 3 times; not replayed again: {LOST}"
    assert engine.active == 0 and engine.scheduler.releases() == []
