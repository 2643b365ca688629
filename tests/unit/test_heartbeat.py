"""Heartbeats and blame without processes (pipeline/heartbeat.py, watchdog.py, life.py): which
links are pinged, when a silent one breaks the chain, whom a late step blames, and whom a failed
reconnect blames; a broken chain's repair hurried by a waiting request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count
from types import SimpleNamespace
from typing import Any

import pytest

from shardline.errors import ShardlineError
from shardline.pipeline.deadline import Deadlines, StepClock
from shardline.pipeline.heartbeat import ping_quiet, quiet_for, settle_for
from shardline.pipeline.life import REPAIR_FIRST_S, ChainLife, Sent
from shardline.pipeline.watchdog import overdue, silent
from shardline.wire.messages import Message, Phase, Ping

WORKERS = ["10.0.0.1:7001", "10.0.0.2:7002"]


@dataclass
class FakeLink:
    heard: float
    busy: bool = False  # another send under way: try_send declines
    sent: list[Message] = field(default_factory=list)
    closed: bool = False

    def try_send(self, msg: Message) -> bool:
        if self.busy:
            return False
        self.sent.append(msg)
        return True

    def close(self) -> None:
        self.closed = True


def life_of(links: list[Any]) -> ChainLife:
    life = ChainLife(lambda: links, lambda links, epoch: None, reconnect_s=1.0)
    life.connect()
    life.adopted_at = time.monotonic() - 100  # adopted long ago: silence counts from `heard`
    return life


def late_step(life: ChainLife, ago: float) -> None:
    with life.lock:
        life.pending[1] = Sent(SimpleNamespace(phase=Phase.DECODE), out_at=time.monotonic() - ago)  # type: ignore[arg-type]


def test_the_window_is_split_into_pings_a_silence_and_a_settle() -> None:
    assert quiet_for(5.0) == 4.0  # a worker stopped right after its last answer is seen in 4 s + a tick
    assert settle_for(5.0) == 2.5 and settle_for(0.0) == 0.0 and quiet_for(0.0) == 0.0


def test_only_quiet_links_are_pinged_and_a_busy_one_is_skipped() -> None:
    now = time.monotonic()
    links = [FakeLink(now - 2), FakeLink(now - 0.1), FakeLink(now - 3, busy=True)]
    assert ping_quiet(links, 1.0, count(7)) == 1  # type: ignore[arg-type]
    assert links[0].sent == [Ping(7)] and links[1].sent == [] and links[2].sent == []


def test_a_silent_link_breaks_the_chain_naming_its_worker() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now - 0.5), FakeLink(now - 4.5)])
    assert [i for i, _ in silent(life.links, life.adopted_at, 4.0)] == [1]  # type: ignore[arg-type]
    reason, epoch, down = overdue(life, StepClock(Deadlines(10.0)), WORKERS, lambda: None, quiet_s=4.0) or ("", 0, ())
    assert reason.startswith(f"worker {WORKERS[1]} sent nothing for 4.") and "not even an answer to a ping" in reason
    assert (epoch, down) == (life.epoch, frozenset({1}))
    assert overdue(life, StepClock(Deadlines(10.0)), WORKERS, lambda: None, quiet_s=0.0) is None  # no pings: no check


def test_silence_counts_from_when_the_links_were_adopted() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now - 50), FakeLink(now - 50)])  # a slow handshake (shard delivery)
    life.adopted_at = now - 1
    assert overdue(life, StepClock(Deadlines(10.0)), WORKERS, lambda: None, quiet_s=4.0) is None


def test_a_late_step_blames_the_workers_not_heard_from_since_it_went_out() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now - 0.2), FakeLink(now - 3.5)])  # the first answered a ping meanwhile
    late_step(life, ago=3.0)
    got = overdue(life, StepClock(Deadlines(1.0)), WORKERS, lambda: None, quiet_s=4.0, settle_s=2.5)
    assert got == (f"worker {WORKERS[1]} did not answer a decode step within 1.0 s", life.epoch, frozenset({1}))


def test_a_late_step_waits_for_the_pings_then_blames_all_when_all_were_quiet() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now - 3.5), FakeLink(now - 3.5)])
    late_step(life, ago=2.0)
    assert overdue(life, StepClock(Deadlines(1.0)), WORKERS, lambda: None, quiet_s=4.0, settle_s=2.5) is None
    late_step(life, ago=3.0)
    reason, _, down = overdue(life, StepClock(Deadlines(1.0)), WORKERS, lambda: None, quiet_s=4.0,
                              settle_s=2.5) or ("", 0, ())
    assert down == frozenset() and reason.endswith("did not answer a decode step within 1.0 s (one of them hung?)")


def test_a_broken_chain_is_judged_no_more() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now - 9), FakeLink(now - 9)])
    assert life.break_("gone", life.epoch, frozenset({0})) == []
    assert life.down == frozenset({0}) and all(link.closed for link in life.links)  # type: ignore[attr-defined]
    assert overdue(life, StepClock(Deadlines(1.0)), WORKERS, lambda: None, quiet_s=4.0) is None


def test_a_failed_reconnect_blames_the_worker_it_waited_on_and_a_request_hurries_the_repair() -> None:
    now = time.monotonic()
    life = life_of([FakeLink(now), FakeLink(now)])
    life.break_("worker A sent nothing", life.epoch, frozenset({0}))
    life.reaching = 1  # the attempt got past the first worker and waited on the second

    def stuck() -> list[Any]:
        raise ShardlineError("no answer within 1.0 s")

    life._open = stuck
    life._repair_gap = 4.0
    assert life.repair_due(busy=False) is False  # not yet: the first repair is due later
    life.hurry()
    assert life.repair_due(busy=False) is True and life.repair() is False
    assert life.down == frozenset({1}) and life.broken == "worker A sent nothing; reconnecting for 3 s failed: " \
        "no answer within 1.0 s"
    life.hurry()  # after a failed attempt: due at once again, from the shortest gap
    assert life.repair_due(busy=False) is True and life._repair_gap == REPAIR_FIRST_S


def test_the_compaction_threshold_stays_within_what_a_worker_lets_a_row_hold() -> None:
    from shardline.config import MAX_COMPACT_AT, SpeculationConfig
    from shardline.node.bounds import SLACK_SLOTS

    assert MAX_COMPACT_AT + 2 * (32 + 1) <= SLACK_SLOTS  # masked slots + a step's drafts (k_max <= 32), twice
    assert SpeculationConfig(compact_at=MAX_COMPACT_AT).compact_at == MAX_COMPACT_AT
    with pytest.raises(ShardlineError, match=f"threshold must be 1-{MAX_COMPACT_AT} masked slots, got 257"):
        SpeculationConfig(compact_at=257)
