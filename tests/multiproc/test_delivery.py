"""Shard delivery between real processes: a worker started on an empty folder gets its shard from
the coordinator, verified and cached, and serves the same tokens; its next start transfers
nothing; a corrupt file is refused on both sides with one clear reason and is not kept."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.model.context import run_context
from shardline.model.manifest import MANIFEST, load_manifest, verify
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.stage.block_ops import DERIVED
from tests.helpers import engine_tokens
from tests.multiproc.procs import Proc, worker

GREEDY = SamplingConfig(max_tokens=6)


@pytest.fixture(scope="module")
def export(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


@pytest.fixture(scope="module")
def first(export: Path) -> Iterator[Proc]:
    """Stage 1 from the complete export: only stage 2's worker starts empty here."""
    w = worker(export, "1")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def reference(export: Path) -> list[int]:
    return _tokens(LocalPipeline(export, RunConfig()), export)


def _tokens(pipe: LocalPipeline | RemotePipeline, export: Path) -> list[int]:
    prompt = ChatTokenizer(export).encode_chat([{"role": "user", "content": "Name a large mammal."}])
    return engine_tokens(pipe, prompt, GREEDY)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_an_empty_worker_gets_its_shard_and_its_next_start_uses_the_cache(
        export: Path, first: Proc, reference: list[int], tmp_path: Path) -> None:
    cache = tmp_path / "not-yet-created"
    second = worker(cache, "2")
    try:
        remote = RemotePipeline(export, [first.addr, second.addr], RunConfig(), activations="f32")
        wanted = [MANIFEST, "stage2.xml", "stage2.bin"]
        assert remote.delivered == [(second.addr, n, (export / n).stat().st_size) for n in wanted]
        assert _tokens(remote, export) == reference
        remote.shutdown()
        # nothing else, no temporary file; beside them, the plugin's form the exact stage was
        # loaded from (stage/block_ops.py), made once and whole
        assert _files(cache) == sorted([*wanted, DERIVED])
        assert [p.name for p in (cache / DERIVED).glob("*/*")] in (["stage2.xml", "stage2.bin"],
                                                                   ["stage2.bin", "stage2.xml"])
        verify(cache, load_manifest(cache), only=wanted[1:])
        log = second.wait_for_stderr("stages 2-2 loaded")
        size = (export / "stage2.bin").stat().st_size
        assert f"received stage2.bin: {size} bytes, sha256 verified, cached in {cache}" in log
    finally:
        second.stop()

    again = worker(cache, "2", port=second.port)
    try:
        remote = RemotePipeline(export, [first.addr, again.addr], RunConfig(), activations="f32")
        assert remote.delivered == []
        assert remote.links[1].bytes_sent < 400  # a Hello and a Route: no file went out
        assert _tokens(remote, export) == reference
        remote.shutdown()
        assert "received" not in again.stderr()
    finally:
        again.stop()


def _rotten_copy(export: Path, into: Path) -> Path:
    """The coordinator's folder with one flipped byte in stage2.bin (the rest linked, not copied)."""
    into.mkdir()
    for p in export.iterdir():
        (into / p.name).symlink_to(p)
    (into / "stage2.bin").unlink()
    shutil.copyfile(export / "stage2.bin", into / "stage2.bin")
    with (into / "stage2.bin").open("r+b") as f:
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 0x01]))
    return into


def test_a_corrupt_transfer_is_refused_on_both_sides_and_nothing_invalid_is_kept(
        export: Path, first: Proc, reference: list[int], tmp_path: Path) -> None:
    rotten = _rotten_copy(export, tmp_path / "coordinator")
    cache = tmp_path / "worker"
    second = worker(cache, "2")
    try:
        got = hashlib.sha256((rotten / "stage2.bin").read_bytes()).hexdigest()[:12]
        want = load_manifest(export).files["stage2.bin"][:12]
        reason = (f"stage2.bin received from the coordinator does not match the manifest's sha256 "
                  f"(got {got}, expected {want}): discarded, nothing cached")
        with pytest.raises(ShardlineError, match=rf"^worker {second.addr}: {re.escape(reason)}$"):
            RemotePipeline(rotten, [first.addr, second.addr], RunConfig(), activations="f32")
        assert reason in second.wait_for_stderr(reason)
        assert _files(cache) == [MANIFEST, "stage2.xml"]  # verified files stay; no stage2.bin, no temp file

        # The worker is still listening: a coordinator with a sound copy completes it, sending only
        # what it still lacks.
        remote = RemotePipeline(export, [first.addr, second.addr], RunConfig(), activations="f32")
        assert [name for _, name, _ in remote.delivered] == ["stage2.bin"]
        assert _tokens(remote, export) == reference
        remote.shutdown()
    finally:
        second.stop()


def test_an_empty_worker_refuses_to_start_from_another_worker(export: Path, tmp_path: Path) -> None:
    """Only a coordinator can deliver a shard: a worker that asks an empty worker is told so."""
    from shardline.wire.link import Link, Refused, client_handshake
    from shardline.wire.messages import PROTOCOL, Activations, Hello, Role

    empty = worker(tmp_path / "w", "2")
    try:
        link = Link.connect("127.0.0.1", empty.port, None)
        m = load_manifest(export)
        with pytest.raises(Refused, match="^the worker for stages 2-2 has no shard yet: only a coordinator can "
                                          "deliver it$"):
            client_handshake(link, Hello(PROTOCOL, Role.WORKER, m.model_hash, 10, 19, m.weights, Activations.ANY,
                                         "ab" * 16, run_context(m.arch, None)), lambda _: None)
        link.close()
    finally:
        empty.stop()
