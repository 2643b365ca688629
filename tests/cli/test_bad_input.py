"""Bad input: one clear error line, a non-zero exit, and no folder that looks complete."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.cli import main

# The installed console script, beside the interpreter running the tests (the venv need not be on PATH).
SHARDLINE = str(Path(sys.executable).parent / "shardline")


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error" in line]  # other lines may be progress bars
    assert len(errors) == 1 and errors[0] == err[-1], err
    assert err[-1].startswith("shardline: error: ") and message in err[-1], err[-1]


def _no_export_left(parent: Path) -> None:
    assert not any((p / "manifest.json").exists() for p in parent.iterdir())
    assert not any(p.name.startswith(".") and "partial" in p.name for p in parent.iterdir())


def test_missing_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--model", str(tmp_path / "nope.gguf"), "--stages", "2", "--out",
                    str(tmp_path / "out")], "model path does not exist")
    _no_export_left(tmp_path)


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    _fails(capsys, ["export", "--model", str(model), "--stages", "1", "--out", str(tmp_path / "out")],
           "unsupported architecture 'gpt2'")
    _no_export_left(tmp_path)


def test_more_stages_than_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--stages", "31", "--out", str(tmp_path / "out")],
           "cannot split 30 layers into 31 stages")
    _no_export_left(tmp_path)


def test_empty_layer_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--layers", "0-9,10-9,10-29", "--out", str(tmp_path / "out")],
           "empty layer range '10-9'")
    _no_export_left(tmp_path)


def test_unwritable_output_folder(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--stages", "1", "--out", "/proc/shardline-out"], "cannot write to /proc")
    assert not Path("/proc/shardline-out").exists()


def test_int4_group_size_must_divide_hidden(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--stages", "1", "--weights", "int4", "--group-size", "128", "--out",
                    str(tmp_path / "out")], "group size 128 does not divide the model's dimension 576")


def test_missing_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.model.reference import save_tiny_hf

    model = save_tiny_hf(tmp_path / "tiny", "llama")
    (model / "tokenizer.json").unlink()
    _fails(capsys, ["export", "--model", str(model), "--stages", "2", "--out", str(tmp_path / "x")],
           "has no tokenizer.json")
    assert not (tmp_path / "x").exists()


def test_failure_in_a_later_stage_leaves_no_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 0 exports fine, stage 1 lacks a tensor: nothing may be left behind."""
    from safetensors.numpy import load_file, save_file

    from tests.model.reference import save_tiny_hf

    model = save_tiny_hf(tmp_path / "tiny", "llama")
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.5.mlp.down_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    out_parent = tmp_path / "outs"
    out_parent.mkdir()
    _fails(capsys, ["export", "--model", str(model), "--stages", "2", "--out", str(out_parent / "x")],
           "tensor model.layers.5.mlp.down_proj.weight is missing")
    assert list(out_parent.iterdir()) == []


def test_existing_output_folder_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails(capsys, ["export", "--stages", "1", "--out", str(tmp_path / "out")], "already exists")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.fixture
def copy_of(shards: Callable[..., Path], tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(shards("fp32", stages=2), dst)
    return dst


def test_inspect_ok(copy_of: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(copy_of)]) == 0
    out = capsys.readouterr().out
    assert "all checksums verified" in out and "0-14" in out and "15-29" in out


def test_corrupt_manifest(copy_of: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (copy_of / "manifest.json").write_text('{"format_version": 1, "stages": [')
    _fails(capsys, ["inspect", str(copy_of)], "corrupt manifest")


def test_corrupt_shard(copy_of: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with (copy_of / "stage1.bin").open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02\x03")
    _fails(capsys, ["inspect", str(copy_of)], "checksum mismatch for stage1.bin")
    _fails(capsys, ["generate", "--shards", str(copy_of), "hi"], "checksum mismatch for stage1.bin")


def test_missing_shard_file(copy_of: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (copy_of / "stage0.xml").unlink()
    _fails(capsys, ["inspect", str(copy_of)], "file stage0.xml named in the manifest is missing")


def test_not_an_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["inspect", str(tmp_path)], "manifest.json is missing")
    _fails(capsys, ["generate", "--shards", str(tmp_path / "nope"), "hi"], "shard folder does not exist")


def test_console_script_generates_only_the_answer(shards: Callable[..., Path]) -> None:
    folder = shards("fp32", stages=2)
    run = subprocess.run([SHARDLINE, "generate", "--shards", str(folder), "--max-tokens", "16",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "The capital of France is Paris.\n"


def test_console_script_error_exit(tmp_path: Path) -> None:
    run = subprocess.run([SHARDLINE, "inspect", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip() == f"shardline: error: {tmp_path} is not a shardline export: manifest.json is missing"


@pytest.mark.parametrize("flags,message", [
    (["--draft", "ngram", "--draft-k", "0"], "--draft-k must be 'auto' or in 1-8, got 0"),
    (["--draft", "ngram", "--draft-k", "9"], "--draft-k must be 'auto' or in 1-8, got 9"),
    (["--draft", "ngram", "--draft-k", "-1"], "--draft-k must be a number of drafts or 'auto', got '-1'"),
    (["--draft", "ngram", "--draft-k", "many"], "--draft-k must be a number of drafts or 'auto'"),
    (["--draft", "layers:0"], "--draft layers:L needs a layer count L >= 1, got 'layers:0'"),
    (["--draft", "layers:x"], "needs a layer count L >= 1"),
    (["--draft", "layers:2"], "--draft layers:2: the target has 2 layers; a draft keeps 1 to 1"),
    (["--draft", "/nowhere/draft"], "draft model: shard folder does not exist: /nowhere/draft"),
])
def test_bad_speculation_flags(tiny_models: tuple[Path, Path], flags: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["generate", "--shards", str(tiny_models[1]), "hi", *flags], message)


def test_console_script_speculates_and_reports_it(shards: Callable[..., Path]) -> None:
    folder = shards("fp32", stages=2)
    run = subprocess.run([SHARDLINE, "generate", "--shards", str(folder), "--max-tokens", "16", "--draft", "ngram",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "The capital of France is Paris.\n"
    assert re.fullmatch(r"speculation: \d+/\d+ drafts accepted \(\d+%\) in \d+ steps, last K \d+\n", run.stderr)
