"""Shard delivery without OpenVINO: a fake three-stage export, real links over a socket pair, the
real handshakes. An empty folder gets exactly its files, verified; a second run asks for
nothing; a corrupt transfer is refused on both sides and leaves no file that looks valid."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from shardline.model.arch import Arch
from shardline.model.manifest import MANIFEST, Manifest, StageEntry, hash_files
from shardline.node import delivery
from shardline.node.delivery import DeliveryError, chunks, fetch, lacking, safe_name, stage_files
from shardline.wire.link import Link, Refused, client_handshake, refuse, server_handshake
from shardline.wire.messages import PROTOCOL, Activations, Hello, Message, Refuse, ShardRequest

MODEL = "ab" * 32
SMALL_CHUNK = 4096  # several chunks per file, as a 4 MiB chunk does with real shards


def _export(folder: Path, model: str = MODEL) -> Manifest:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    stages = []
    for k in range(3):
        (folder / f"stage{k}.xml").write_text(f"<net stage='{k}'/>")
        (folder / f"stage{k}.bin").write_bytes(rng.bytes(10_000 + 1000 * k))
        stages.append(StageEntry(k, k, k, k == 0, k == 2, f"stage{k}.xml", f"stage{k}.bin", [], [], []))
    (folder / "tokenizer.json").write_text("{}")
    arch = Arch(family="llama", n_layers=3, hidden=8, n_heads=2, n_kv_heads=1, head_dim=4,
                intermediate=16, vocab=32, rope_theta=10000.0, rms_eps=1e-5, tied_embeddings=True, max_context=64)
    manifest = Manifest({"path": "m.gguf", "format": "gguf", "sha256": model}, arch, "gguf", None, stages,
                        hash_files(folder), {})
    (folder / MANIFEST).write_text(manifest.to_json())
    return manifest


def _hello(role: str, model: str = MODEL, first: int = 0, last: int = 0) -> Hello:
    return Hello(PROTOCOL, role, model, first, last, "gguf", Activations.F16, "ab" * 16, 8192)


class Exchange:
    """A coordinator (client) and a worker (server) handshake on a socket pair; the worker fetches
    what `folder` lacks for stage 1 before it answers, as StageWorker does."""

    def __init__(self, source: Path, folder: Path, hello_model: str = MODEL) -> None:
        self.source, self.folder = source, folder
        self.manifest = Manifest.from_dict(json.loads((source / MANIFEST).read_text()))
        self.requests: list[str] = []
        self.received = -1
        self.worker_error: Exception | None = None
        a, b = socket.socketpair()
        self.coordinator_link, self.worker_link = Link(a, "coordinator"), Link(b, "worker")
        self.hello = _hello("coordinator", hello_model)

    def _serve(self, msg: Message) -> None:
        assert isinstance(msg, ShardRequest)
        self.requests.append(msg.name)
        try:
            delivery.serve(self.coordinator_link, self.source, self.manifest, msg, SMALL_CHUNK)
        except DeliveryError as e:
            raise refuse(self.coordinator_link, str(e)) from None

    def _worker(self) -> None:
        def mine(peer: Hello) -> Hello:
            manifest, self.received = fetch(self.worker_link, self.folder, peer, 1, 1)
            return _hello("worker", manifest.model_hash, 1, 1)

        try:
            server_handshake(self.worker_link, mine, lambda _: None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            self.worker_error = e

    def run(self) -> Hello:
        t = threading.Thread(target=self._worker)
        t.start()
        try:
            return client_handshake(self.coordinator_link, self.hello, lambda _: None, self._serve)
        finally:
            t.join(timeout=10)


def test_chunks_are_bounded_in_order_and_reassemble(tmp_path: Path) -> None:
    data = np.random.default_rng(0).bytes(10_000)
    (tmp_path / "f").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    got = list(chunks(tmp_path / "f", "f", sha, 4096))
    assert [(c.offset, c.data.size, c.total, c.sha256) for c in got] == [
        (0, 4096, 10_000, sha), (4096, 4096, 10_000, sha), (8192, 1808, 10_000, sha)]
    assert b"".join(c.data.tobytes() for c in got) == data
    (tmp_path / "empty").write_bytes(b"")
    assert [(c.offset, c.data.size, c.total) for c in chunks(tmp_path / "empty", "empty", "x")] == [(0, 0, 0)]


@pytest.mark.parametrize("name", ["../stage1.bin", "/etc/passwd", "", "a/../../b", "a\\..\\b"])
def test_names_that_could_leave_the_folder_are_refused(name: str) -> None:
    with pytest.raises(DeliveryError, match="not a plain relative path"):
        safe_name(name)


def test_stage_files_and_what_a_folder_lacks(tmp_path: Path) -> None:
    manifest = _export(tmp_path)
    assert stage_files(manifest, 1, 2) == ["stage1.xml", "stage1.bin", "stage2.xml", "stage2.bin"]
    with pytest.raises(DeliveryError, match=r"this worker hosts stages 2-3, but the model has stages 0-2 "
                                            r"\(stage 0 is the coordinator's\)"):
        stage_files(manifest, 2, 3)
    assert lacking(tmp_path, manifest, stage_files(manifest, 1, 2)) == []
    (tmp_path / "stage1.xml").unlink()
    with (tmp_path / "stage2.bin").open("r+b") as f:
        f.write(b"\x00")
    assert lacking(tmp_path, manifest, stage_files(manifest, 1, 2)) == ["stage1.xml", "stage2.bin"]


def test_an_empty_folder_receives_its_files_verified_and_a_second_run_asks_for_nothing(tmp_path: Path) -> None:
    _export(tmp_path / "coordinator")
    ex = Exchange(tmp_path / "coordinator", tmp_path / "worker" / "new")
    assert ex.run().first_layer == 1 and ex.worker_error is None
    assert ex.requests == [MANIFEST, "stage1.xml", "stage1.bin"]
    assert sorted(p.name for p in ex.folder.iterdir()) == [MANIFEST, "stage1.bin", "stage1.xml"]
    for name in ex.requests:
        assert (ex.folder / name).read_bytes() == (ex.source / name).read_bytes()
    assert ex.received == sum((ex.source / n).stat().st_size for n in ex.requests)
    again = Exchange(ex.source, ex.folder)
    again.run()
    assert (again.requests, again.received, again.worker_error) == ([], 0, None)


def test_a_corrupt_file_is_refused_on_both_sides_and_not_kept(tmp_path: Path) -> None:
    manifest = _export(tmp_path / "coordinator")
    with (tmp_path / "coordinator" / "stage1.bin").open("r+b") as f:  # the coordinator's copy rotted
        f.seek(5000)
        f.write(b"\xff\xfe")
    ex = Exchange(tmp_path / "coordinator", tmp_path / "worker")
    got = hashlib.sha256((ex.source / "stage1.bin").read_bytes()).hexdigest()
    reason = (f"stage1.bin received from the coordinator does not match the manifest's sha256 "
              f"(got {got[:12]}, expected {manifest.files['stage1.bin'][:12]}): discarded, nothing cached")
    with pytest.raises(Refused) as coordinator_side:
        ex.run()
    assert str(coordinator_side.value) == reason
    assert isinstance(ex.worker_error, Refused) and str(ex.worker_error) == reason
    # Verified files stay (they are good); the corrupt one is gone, and so is its temporary file.
    assert sorted(p.name for p in ex.folder.iterdir()) == [MANIFEST, "stage1.xml"]


def test_a_manifest_for_another_model_is_not_kept(tmp_path: Path) -> None:
    _export(tmp_path / "coordinator")
    ex = Exchange(tmp_path / "coordinator", tmp_path / "worker", hello_model="cd" * 32)
    with pytest.raises(Refused, match="the delivered manifest is for model abababababab, but the coordinator's "
                                      "Hello says cdcdcdcdcdcd"):
        ex.run()
    assert list(ex.folder.iterdir()) == []


def test_a_cached_folder_of_another_model_is_refused(tmp_path: Path) -> None:
    _export(tmp_path / "coordinator")
    _export(tmp_path / "worker", model="ef" * 32)
    ex = Exchange(tmp_path / "coordinator", tmp_path / "worker")
    with pytest.raises(Refused, match=r"model hash mismatch: the worker's folder .*worker holds model efefefefefef, "
                                      r"the coordinator has abababababab"):
        ex.run()
    assert ex.requests == []


def test_the_coordinator_serves_only_the_manifest_and_what_it_names(tmp_path: Path) -> None:
    _export(tmp_path / "coordinator")
    (tmp_path / "coordinator" / "notes.txt").write_text("not part of the export")
    def ask(ex: Exchange, name: str) -> None:  # a worker that asks for something else
        assert isinstance(ex.worker_link.recv(), Hello)
        ex.worker_link.send(ShardRequest(name))
        answer = ex.worker_link.recv()
        ex.worker_error = Refused(answer.reason) if isinstance(answer, Refuse) else None

    for name, reason in [("notes.txt", "the coordinator's export has no file 'notes.txt'"),
                         ("../coordinator/stage1.bin", "refusing file name '../coordinator/stage1.bin': "
                                                       "not a plain relative path")]:
        ex = Exchange(tmp_path / "coordinator", tmp_path / "worker")
        t = threading.Thread(target=ask, args=(ex, name))
        t.start()
        with pytest.raises(Refused, match=f"^{reason}$"):
            client_handshake(ex.coordinator_link, ex.hello, lambda _: None, ex._serve)
        t.join(timeout=10)
        assert str(ex.worker_error) == reason
