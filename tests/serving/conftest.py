"""What the serving tests share: the default model's 2-stage gguf export (the serve default),
and every stage of it in this process (one pipeline per test module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.pipeline.local import LocalPipeline


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def pipe(two: Path) -> Iterator[LocalPipeline]:
    with LocalPipeline(two, RunConfig()) as p:
        yield p
