"""The flags that set what happens when a worker dies or hangs: each one reaches RecoveryConfig,
and a value out of range (negative, zero, not a number, infinite) is refused with one line
naming the flag, before any model is loaded or exported."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.cli import _parser, _recovery, main
from shardline.config import RecoveryConfig
from tests.cli.test_bad_input import _fails


def test_the_flags_reach_the_config() -> None:
    args = _parser().parse_args(["serve", "--step-deadline", "2.5", "--step-deadline-multiple", "8",
                                 "--reconnect-window", "4", "--max-replays", "0", "--replay-within", "9",
                                 "--heartbeat", "2"])
    assert _recovery(args) == RecoveryConfig(step_floor_s=2.5, step_multiple=8.0, reconnect_s=4.0, max_replays=0,
                                             replay_within_s=9.0, heartbeat_s=2.0)
    assert _recovery(_parser().parse_args(["serve", "--heartbeat", "0"])).heartbeat_s == 0  # pings off
    assert _recovery(_parser().parse_args(["generate", "hi"])) == RecoveryConfig()


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--step-deadline", "0", "--step-deadline must be in (0, 3600] seconds, got 0.0"),
    ("--step-deadline", "nan", "--step-deadline must be in (0, 3600] seconds, got nan"),
    ("--step-deadline", "inf", "--step-deadline must be in (0, 3600] seconds, got inf"),
    ("--step-deadline-multiple", "0.5", "--step-deadline-multiple must be in 1-1000, got 0.5"),
    ("--reconnect-window", "-1", "--reconnect-window must be in (0, 3600] seconds, got -1.0"),
    ("--max-replays", "-1", "--max-replays must be in 0-100, got -1"),
    ("--max-replays", "101", "--max-replays must be in 0-100, got 101"),
    ("--heartbeat", "0.5", "--heartbeat must be 0 (off) or in 1-3600 seconds, got 0.5"),
    ("--heartbeat", "-5", "--heartbeat must be 0 (off) or in 1-3600 seconds, got -5.0"),
    ("--heartbeat", "nan", "--heartbeat must be 0 (off) or in 1-3600 seconds, got nan"),
    ("--replay-within", "1e9", "--replay-within must be in (0, 3600] seconds, got 1000000000.0"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_out_of_range_values_are_refused(command: str, flag: str, value: str, message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # a --shards folder that is not an export: the flags are checked before it is looked at
    argv = [command, *(["hi"] if command == "generate" else []), "--shards", str(tmp_path), flag, value]
    _fails(capsys, argv, message)


def test_a_value_that_is_not_a_number_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--max-replays", "two"])
    assert stop.value.code == 2
    assert "argument --max-replays: invalid int value: 'two'" in capsys.readouterr().err
