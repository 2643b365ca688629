"""Each stage names the runner that runs it (issue 24 point 4): the manifest's `runner`, opened by
stage/runners.py. An export says "stateful"; a manifest made before runner kinds (no key) is
stateful; a kind this shardline does not have is one clear error, not a crash. Architectures are
found by themselves: every module of model/families declares its own."""

from __future__ import annotations

import json
import pkgutil
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import shardline.model.families as families
from shardline.cli import main
from shardline.model.families import FAMILIES
from shardline.model.manifest import load_manifest
from tests.cli.test_bad_input import _fails


def _with_runner(src: Path, dst: Path, runner: str | None) -> Path:
    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    doc = json.loads(path.read_text())
    for stage in doc["stages"]:
        if runner is None:
            stage.pop("runner", None)
        else:
            stage["runner"] = runner
    path.write_text(json.dumps(doc))
    return dst


def test_an_export_names_its_stages_runner(shards: Callable[..., Path]) -> None:
    assert [s.runner for s in load_manifest(shards("fp32", stages=2)).stages] == ["stateful", "stateful"]


def test_a_manifest_without_runner_kinds_runs_stateful(shards: Callable[..., Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    folder = shards("fp32", stages=2)
    old = _with_runner(folder, tmp_path / "old", None)
    argv = ["--raw", "The capital of France is", "--max-tokens", "4"]
    assert main(["generate", "--shards", str(old), *argv]) == 0
    before = capsys.readouterr().out
    assert main(["generate", "--shards", str(folder), *argv]) == 0
    assert capsys.readouterr().out == before


def test_a_runner_kind_this_shardline_lacks_is_one_clear_error(shards: Callable[..., Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = _with_runner(shards("fp32", stages=2), tmp_path / "npu2", "npu2")
    _fails(capsys, ["generate", "--shards", str(folder), "--raw", "hi"],
           "stage0 of " + str(folder) + " needs a 'npu2' runner; this shardline runs stateful, static stages")


def test_a_static_manifest_without_its_ring_is_one_clear_error(shards: Callable[..., Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = _with_runner(shards("fp32", stages=2), tmp_path / "static", "static")
    _fails(capsys, ["generate", "--shards", str(folder), "--raw", "hi"],
           "stage0 of " + str(folder) + " is static but its manifest names no ring")


def test_every_family_module_is_found() -> None:
    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - {"base", "refused"}
    declared = {f.name for m in modules for f in __import__(f"shardline.model.families.{m}",
                                                            fromlist=["FAMILIES"]).FAMILIES}
    assert declared == set(FAMILIES) == {"gemma3", "llama", "mistral", "mistral3", "qwen2", "qwen3",
                                                    "qwen3moe", "smollm3", "gpt-oss", "mixtral"}


@pytest.mark.parametrize("cfg,paged", [
    ({}, True),  # serve and generate: the paged export (issue 41)
    ({"prefix_cache_mb": 0, "max_streams": 1}, True),
    ({"disaggregate": (1, 1)}, True),  # its bundled length predictor reads paged summaries (issue 56)
    ({"disaggregate": (2, 1), "flip": True}, True),  # roles flip over a paged pipeline (issue 56)
    ({"disaggregate": (1, 1), "kv_transfer": "chunk"}, True),  # full blocks read out as chunks write them
])
def test_the_default_model_is_served_paged_whatever_is_served(cfg: dict[str, object], paged: bool,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    import shardline.cli as cli
    from shardline.config import ServeConfig

    asked: list[bool] = []
    monkeypatch.setattr(cli, "default_shards", lambda paged=True: asked.append(paged) or tmp_path)
    assert cli.default_model(ServeConfig(**cfg)) == tmp_path  # type: ignore[arg-type]
    assert asked == [paged]
