"""A loaded stage does not keep its shard file resident: the plugin's own copy of the weights is
made at load (a warm-up token), and the mapped original's pages are handed back (stage/resident.py).
The answers are those of a stage that keeps them (the release is advice, never a change of data)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.model.manifest import load_manifest
from shardline.pipeline.local import LocalPipeline
from shardline.stage.block_ops import DERIVED
from shardline.stage.resident import mapped_ranges
from shardline.stage.runner import StageRunner
from tests.helpers import greedy_ours

EXACT = RunConfig(precision="exact")


def resident_bytes(path: Path) -> int:
    """This process's resident bytes of its mappings of `path` (/proc/self/smaps)."""
    target, total, inside = str(path.resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            inside = len(fields) == 6 and fields[5] == target
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_mapped_ranges_reads_the_maps_format() -> None:
    maps = ("7f00-7f80 r--p 00000000 fd:01 12 /tmp/x/stage0.bin\n"
            "7f80-7fa0 r--p 00080000 fd:01 12 /tmp/x/stage0.bin\n"
            "8000-9000 r--p 00000000 fd:01 13 /tmp/x/stage1.bin\n"
            "a000-b000 rw-p 00000000 00:00 0\n")
    assert mapped_ranges(Path("/tmp/x/stage0.bin"), maps) == [(0x7F00, 0x7F80), (0x7F80, 0x7FA0)]
    assert mapped_ranges(Path("/tmp/x/none.bin"), maps) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) is Linux's")
def test_a_loaded_stage_holds_almost_none_of_its_shard_file(shards: Callable[..., Path], tmp_path: Path) -> None:
    folder = tmp_path / "copy"  # a file of its own: no other pipeline of the session maps it
    shutil.copytree(shards("gguf", stages=2), folder)
    entry = load_manifest(folder).stages[1]
    shard = folder / entry.bin
    runner = StageRunner(folder, entry, EXACT)
    # Under exact the plugin maps the plugin's form of the shard's blocks, written beside it
    # (stage/block_ops.py): that is the file whose pages go back.
    (weights,) = (folder / DERIVED).rglob(entry.bin)
    assert mapped_ranges(weights), "the plugin maps the stage's weights"
    assert resident_bytes(weights) < 0.1 * weights.stat().st_size
    assert resident_bytes(shard) < 0.1 * shard.stat().st_size
    del runner


def test_answers_after_the_release_equal_those_of_shared_shards(shards: Callable[..., Path], tmp_path: Path) -> None:
    """Greedy tokens of a pipeline whose shards were released equal those of the session's."""
    folder = tmp_path / "copy"
    shutil.copytree(shards("gguf", stages=2), folder)
    prompt = list(range(100, 130))
    with LocalPipeline(folder, EXACT) as mine, LocalPipeline(shards("gguf", stages=2), EXACT) as theirs:
        assert greedy_ours(mine, prompt, 16)[0] == greedy_ours(theirs, prompt, 16)[0]
