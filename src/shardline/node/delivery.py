"""Shard delivery: a worker that lacks files of its shard receives them from the coordinator.

During the handshake, before its own Hello, the worker sends ShardRequest(name) for each file
it lacks, manifest.json first; the coordinator answers each with ShardChunk frames of at most
CHUNK bytes, in order, or with a Refuse. A received file is written under a temporary name in
its folder, checked, and only then renamed into place (atomic within one file system), so a
file under its real name has always been verified and an interrupted or corrupt transfer leaves
nothing that looks valid. A stage file is checked against the sha256 in the worker's manifest;
manifest.json against its chunks' sha256 and the model hash of the coordinator's Hello. The
next start finds the files in place, verifies them as every start does, and asks for nothing.

Names that travel are checked on both sides: only manifest.json and the files the manifest
names are served, and no name may leave the folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.manifest import MANIFEST, Manifest, load_manifest
from shardline.model.source import file_sha256
from shardline.wire.link import Link, Refused, refuse
from shardline.wire.messages import Hello, Message, Refuse, ShardChunk, ShardRequest

CHUNK = 4 << 20  # bytes of file data per frame: bounded memory on both sides
PARTIAL = ".partial"
log = logging.getLogger("shardline.delivery")


class DeliveryError(Exception):
    """Why a transfer cannot go on, in one line for people (the peer gets it as a Refuse)."""


def safe_name(name: str) -> str:
    """`name` if it is a plain relative path inside the folder, else DeliveryError."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise DeliveryError(f"refusing file name {name!r}: not a plain relative path")
    return name


def stage_files(manifest: Manifest, first: int, last: int) -> list[str]:
    """The files a worker for stages first-last needs (the manifest aside)."""
    if not 1 <= first <= last < len(manifest.stages):
        raise DeliveryError(f"this worker hosts stages {first}-{last}, but the model has stages "
                            f"0-{len(manifest.stages) - 1} (stage 0 is the coordinator's)")
    names = [f for e in manifest.stages[first : last + 1] for f in e.files]
    if unhashed := [n for n in names if n not in manifest.files]:
        raise DeliveryError(f"the manifest names {', '.join(unhashed)} but gives no sha256 for them")
    return [safe_name(n) for n in names]


def lacking(folder: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """Those of `names` that are missing from `folder` or differ from the manifest's sha256."""
    return [n for n in names if not (folder / n).is_file() or file_sha256(folder / n) != manifest.files[n]]


# --- coordinator side ------------------------------------------------------------------------


def chunks(path: Path, name: str, sha256: str, size: int = CHUNK) -> Iterator[ShardChunk]:
    """The file as ShardChunk frames of at most `size` bytes (an empty file: one empty chunk)."""
    total = path.stat().st_size
    with path.open("rb") as f:
        offset = 0
        while offset < total or offset == 0:
            data = f.read(min(size, total - offset))
            if len(data) == 0 and total > 0:
                raise DeliveryError(f"{name} shrank to {offset} of {total} bytes while being sent")
            yield ShardChunk(name, offset, total, sha256, np.frombuffer(data, np.uint8))
            offset += len(data)
            if total == 0:
                return


def serve(link: Link, folder: Path, manifest: Manifest, msg: Message, chunk_size: int = CHUNK) -> int:
    """Answer one message a worker sent before its Hello; returns the bytes of file data sent."""
    if not isinstance(msg, ShardRequest):
        raise DeliveryError(f"expected Hello or ShardRequest, got {type(msg).__name__}")
    name = safe_name(msg.name)
    if name != MANIFEST and name not in manifest.files:
        raise DeliveryError(f"the coordinator's export has no file {name!r}")
    path = folder / name
    try:
        # The manifest does not hash itself: its chunks announce the file's own sha256.
        sha = manifest.files.get(name) or file_sha256(path)
        sent = 0
        for chunk in chunks(path, name, sha, chunk_size):
            link.send(chunk)
            sent += chunk.data.size
    except OSError as e:
        raise DeliveryError(f"the coordinator cannot send {name}: {e}") from None
    return sent


# --- worker side -----------------------------------------------------------------------------


def _write_chunks(link: Link, name: str, f: Callable[[memoryview], object]) -> tuple[int, str, str]:
    """Chunks of `name` into `f` until the file is whole: (size, sha256 of the data, announced sha256)."""
    digest = hashlib.sha256()
    got, total, announced = 0, -1, ""
    while got < total or total < 0:
        msg = link.recv()
        if isinstance(msg, Refuse):
            raise Refused(msg.reason)  # the coordinator's own refusal: nothing to send back
        if not isinstance(msg, ShardChunk) or msg.name != name or msg.data.dtype != np.uint8 or msg.data.ndim != 1:
            raise DeliveryError(f"expected a chunk of {name} (u8 bytes), got {type(msg).__name__}")
        if msg.offset != got or (total >= 0 and (msg.total, msg.sha256) != (total, announced)) \
                or got + msg.data.size > msg.total:
            raise DeliveryError(f"chunk of {name} out of order: offset {msg.offset} size {msg.data.size} "
                                f"total {msg.total}, expected offset {got}")
        total, announced = msg.total, msg.sha256
        data = msg.data.data  # the chunk's bytes, no copy
        f(data)
        digest.update(data)
        got += len(data)
    return got, digest.hexdigest(), announced


def receive(link: Link, folder: Path, name: str, expected: str | None,
            check: Callable[[Path], str | None] = lambda _: None) -> int:
    """Ask for one file and keep it only if its sha256 is `expected` (None: the one its chunks
    announce) and `check` of the received file finds nothing wrong. Returns its size."""
    path = folder / safe_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    link.send(ShardRequest(name))
    # A unique temporary name: two workers sharing a folder may fetch the same file at once.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            size, got, announced = _write_chunks(link, name, f.write)
        want = expected or announced
        if got != want:
            raise DeliveryError(f"{name} received from the coordinator does not match the manifest's sha256 "
                                f"(got {got[:12]}, expected {want[:12]}): discarded, nothing cached")
        if reason := check(tmp):
            raise DeliveryError(reason)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("received %s: %d bytes, sha256 verified, cached in %s", name, size, folder)
    return size


def _manifest_check(model_hash: str) -> Callable[[Path], str | None]:
    def check(path: Path) -> str | None:
        try:
            manifest = Manifest.from_dict(json.loads(path.read_text()))
        except (ShardlineError, ValueError, KeyError, TypeError) as e:
            return f"the coordinator's manifest is unreadable: {type(e).__name__}: {e}"
        if manifest.model_hash != model_hash:
            return (f"the delivered manifest is for model {manifest.model_hash[:12]}, "
                    f"but the coordinator's Hello says {model_hash[:12]}")
        return None
    return check


def _cached_manifest(folder: Path) -> Manifest | None:
    try:
        return load_manifest(folder)
    except ShardlineError:
        return None  # missing or unreadable: fetch it again


def fetch(link: Link, folder: Path, coordinator: Hello, first: int, last: int) -> tuple[Manifest, int]:
    """Receive what `folder` lacks for stages first-last from the coordinator at the other end of
    `link` (whose Hello it is); returns the manifest and the bytes received. Any failure is sent
    to the coordinator as a Refuse and raised here as Refused, with the same reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        received = 0
        manifest = _cached_manifest(folder)
        if manifest is None:
            received += receive(link, folder, MANIFEST, None, _manifest_check(coordinator.model_hash))
            manifest = load_manifest(folder)
        elif manifest.model_hash != coordinator.model_hash:
            raise DeliveryError(f"model hash mismatch: the worker's folder {folder} holds model "
                                f"{manifest.model_hash[:12]}, the coordinator has {coordinator.model_hash[:12]}")
        for name in lacking(folder, manifest, stage_files(manifest, first, last)):
            received += receive(link, folder, name, manifest.files[name])
        return manifest, received
    except (DeliveryError, ShardlineError, OSError) as e:
        raise refuse(link, str(e)) from None
