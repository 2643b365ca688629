"""A decode group's verdict on drafts (GroupPace): measured over the group's own steps, from one
settled step to the next, per number of rows, with probes of the other choice."""

from __future__ import annotations

from collections.abc import Callable

from shardline.serving.groups import Groups
from shardline.serving.speculation import PROBE_EVERY, GroupPace


def _run(pace: GroupPace, steps: int, rows: int, step: Callable[[bool], tuple[float, int]]) -> list[bool]:
    """`steps` steps of `rows` rows; a step with drafts (as the verdict allows) takes step(True)
    = (seconds, tokens per row). The verdicts drawn, in order."""
    now, verdicts = 0.0, []
    for _ in range(steps):
        drafts = pace.allow
        verdicts.append(drafts)
        pace.launched(rows, drafts, steady=True)
        seconds, tokens = step(drafts)
        now += seconds
        for _ in range(rows):
            pace.settled(tokens, now, members=rows)
    return verdicts


def test_a_group_stops_drafting_when_its_drafted_steps_give_fewer_tokens_per_second() -> None:
    """4 rows: a step with drafts gives each row 2 tokens in 0.3 s (6.7/s), one without 1 token in
    0.1 s (10/s): the group stops drafting but for a probe every PROBE_EVERY steps."""
    pace = GroupPace()
    verdicts = _run(pace, 8 * PROBE_EVERY, 4, lambda d: (0.3, 2) if d else (0.1, 1))
    late = verdicts[2 * PROBE_EVERY:]
    assert verdicts[0] and 0 < late.count(True) <= len(late) // PROBE_EVERY + 1, verdicts
    assert pace.paces[4].drafts_lose()


def test_a_group_keeps_drafting_while_drafted_steps_give_more() -> None:
    pace = GroupPace()
    verdicts = _run(pace, 8 * PROBE_EVERY, 3, lambda d: (0.15, 2) if d else (0.1, 1))
    assert verdicts.count(False) == (len(verdicts) - 1) // PROBE_EVERY, verdicts  # probes (the first: none)
    assert not pace.paces[3].drafts_lose()


def test_one_row_is_left_to_its_stream_and_row_counts_are_kept_apart() -> None:
    pace = GroupPace()
    assert all(_run(pace, 4 * PROBE_EVERY, 1, lambda d: (0.2, 1) if d else (0.1, 1)))  # never vetoed
    assert pace.paces[1].steps[0] == 0  # no probe: steps without drafts are its stream's to try
    _run(pace, 4 * PROBE_EVERY, 2, lambda d: (0.15, 2) if d else (0.1, 1))
    assert pace.paces[2].steps[0] > 0 and not pace.paces[2].drafts_lose()


def test_a_step_is_timed_only_from_a_settled_step_and_only_when_steady() -> None:
    pace = GroupPace()
    pace.launched(2, False, steady=True)
    pace.settled(1, 1.0, 2)
    pace.settled(1, 1.0, 2)  # the first step: nothing before it to time from
    assert pace.paces == {}
    pace.launched(2, True, steady=True)
    pace.settled(3, 1.5, 2)  # one row back, the other lost with the chain: never settled
    pace.launched(2, True, steady=True)  # the next step is timed afresh
    pace.settled(3, 9.0, 2)
    pace.settled(3, 9.0, 2)
    assert pace.paces == {}
    pace.launched(2, True, steady=False)  # a joiner's prefill ran before it
    pace.settled(2, 9.5, 2)
    pace.settled(2, 9.5, 2)
    assert pace.paces == {}
    pace.launched(2, True, steady=True)
    pace.settled(2, 9.7, 2)
    pace.settled(3, 9.7, 2)
    p = pace.paces[2]
    assert (round(p.seconds[1], 6), p.tokens[1], p.steps[1]) == (0.2, 5, 1)
    pace.settled(3, 10.0, 2)  # an outcome with no step pending changes nothing
    assert p.steps == [0.0, 1.0]


def test_groups_find_a_stream_s_group_and_a_key_s() -> None:
    groups = Groups(2)
    g = groups.join(7)
    assert groups.group_of(7) is g and groups.by_key(g.key) is g
    assert groups.group_of(8) is None and groups.by_key(5) is None
