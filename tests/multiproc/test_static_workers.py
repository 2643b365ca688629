"""A mixed pipeline across processes (issue 25): stage 0 stateful here, stage 1 static on a real
`shardline worker`, which picks the static runner from the manifest. Its greedy tokens are the
all-stateful pipeline's, and a KV export out of it is refused nowhere (the ring's slots are
the cache's slots)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.export.exporter import export
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import export_kv, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.stage.cache import KVBook
from tests.conftest import CHAT_PROMPTS
from tests.helpers import GREEDY, engine_tokens, ok
from tests.multiproc.procs import worker

RING, CHUNK = 160, 16
EXACT = RunConfig(precision="exact")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(ExportConfig(out=tmp_path_factory.mktemp("mixed") / "m", stages=2, weights="gguf",
                               static=frozenset({1}), context=RING, isolate=False, progress=False))


@pytest.fixture(scope="module")
def remote(mixed: Path) -> Iterator[RemotePipeline]:
    w = worker(mixed, "1")
    pipe = RemotePipeline(mixed, [w.addr], EXACT, "f32")
    try:
        yield pipe
    finally:
        pipe.shutdown()
        w.stop()


def test_a_static_stage_on_a_worker_gives_the_stateful_tokens(mixed: Path, remote: RemotePipeline,
                                                               shards: Callable[..., Path]) -> None:
    tok = ChatTokenizer(mixed)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:2]]
    cfg = SamplingConfig(max_tokens=20)
    with LocalPipeline(shards("gguf", stages=2), EXACT) as local:
        want = [engine_tokens(local, p, cfg, chunk=CHUNK, groups=0) for p in prompts]
    assert [engine_tokens(remote, p, cfg, chunk=CHUNK, groups=0) for p in prompts] == want
    assert [p.device for p in remote.placement()] == ["CPU", "CPU"]  # stage 0 here; the worker's Hello says its own


def test_the_kv_of_a_static_stage_leaves_as_a_stateful_stage_s(remote: RemotePipeline) -> None:
    book = KVBook()
    ok(run(remote, prefill(91, book, list(range(5, 25)), GREEDY, first=True, last=True)))
    snap = export_kv(remote, 91).result(120)
    assert (snap.rows, snap.slots, len(snap.stages)) == (1, 20, 2)
    assert {a.shape[2] for s in snap.stages for a in s.arrays.values()} == {20}
    remote.release(91)
