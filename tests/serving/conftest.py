"""What the serving tests share: the default model's 2-stage gguf export (the serve default),
every stage of it in this process (one pipeline per test module), its tokenizer, and grammars
compiled against its vocabulary (constrained decoding's tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig
from shardline.model.grammar import Grammars
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def pipe(two: Path) -> Iterator[LocalPipeline]:
    with LocalPipeline(two, RunConfig()) as p:
        yield p


@pytest.fixture(scope="module")
def tok(two: Path) -> ChatTokenizer:
    return ChatTokenizer(two)


@pytest.fixture(scope="module")
def grammars(two: Path, tok: ChatTokenizer) -> Grammars:
    return Grammars((two / "tokenizer.json").read_text(), load_manifest(two).arch.vocab, tok.stop_ids)
