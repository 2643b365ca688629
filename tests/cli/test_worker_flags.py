"""`shardline worker --kv-cache-mb` through the real command line (issue 54): a value out of
range is one clear error line naming the flag and its bounds, exit 1, before the worker reads
its folder or binds; the help states the default and why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shardline.config import MAX_KV_CACHE_MB, WorkerConfig
from shardline.errors import ShardlineError
from tests.cli.test_bad_input import SHARDLINE


@pytest.mark.parametrize("mib", ["0", str(MAX_KV_CACHE_MB + 1)])
def test_a_worker_refuses_a_kv_cache_out_of_range(tmp_path: Path, mib: str) -> None:
    run = subprocess.run([SHARDLINE, "worker", "--shards", str(tmp_path / "none"), "--stage", "1", "--insecure",
                          "--kv-cache-mb", mib], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == [f"shardline: error: --kv-cache-mb must be in 1-{MAX_KV_CACHE_MB}, "
                                               f"got {mib}"]


def test_a_worker_gives_what_it_is_told_or_half_of_what_is_available() -> None:
    assert WorkerConfig(kv_cache_mb=300).kv_limit(10 << 30) == 300 << 20
    assert WorkerConfig().kv_limit(10 << 30) == 5 << 30
    with pytest.raises(ShardlineError, match=r"^--kv-cache-mb must be in 1-4194304, got -3$"):
        WorkerConfig(kv_cache_mb=-3)


def test_the_worker_s_help_states_the_kv_default() -> None:
    run = subprocess.run([SHARDLINE, "worker", "--help"], capture_output=True, text=True, timeout=60)
    assert "(default: 50% of the memory available at start, leaving the rest to the stages' weights and the " \
           "machine)" in " ".join(run.stdout.split())
