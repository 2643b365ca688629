"""Constrained decoding through real worker processes (issue 40): the last stage is a worker,
which applies the masks each step carries and holds no grammar; the tokens equal the in-process
ones, alone, with drafts, and in a decode group beside a free stream, and the output validates."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from shardline.config import RunConfig
from shardline.model.grammar import Grammars
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.multiproc.procs import Proc, workers_of
from tests.serving.test_constrained import ASK, PERSON, _request, _run


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Proc]]:
    with workers_of(three, "1", "2") as ws:
        yield ws


def test_masks_travel_to_the_last_worker(three: Path, workers: list[Proc]) -> None:
    tok = ChatTokenizer(three)
    grammars = Grammars((three / "tokenizer.json").read_text(), load_manifest(three).arch.vocab, tok.stop_ids)
    ask = tok.encode_chat([{"role": "user", "content": ASK}])
    free = tok.encode_chat([{"role": "user", "content": "Name three rivers."}])

    def both(pipe: LocalPipeline | RemotePipeline, groups: int, drafts: Drafts | None) -> list[list[int]]:
        engine = Engine(pipe, Limits(4, 4), 8192, SchedulerConfig(groups=groups, compact_at=8), drafts)
        try:
            got = _run(engine, [_request(ask, tok, grammars, PERSON), _request(free, tok, None)])
        finally:
            engine.stop()
        assert [f for _, f in got] == ["stop", "length"] or got[0][1] == "stop", got
        return [t for t, _ in got]

    with LocalPipeline(three, RunConfig()) as local:
        want = both(local, 0, None)
    jsonschema.validate(json.loads(tok.decode(want[0])), PERSON)
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), activations="f32")
    try:
        assert both(remote, 0, None) == want
        assert both(remote, 1, Drafts(LookupDrafter, 4, 8)) == want
    finally:
        remote.shutdown()
