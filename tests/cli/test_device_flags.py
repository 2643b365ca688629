"""`--device` per stage (issue 24 point 4): one OpenVINO device for every stage run here, or one
per stage; a list that does not fit the stages, an empty or malformed name, or a device this
machine lacks gets one clear error line; a list of CPUs gives the one-device tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.config import RunConfig
from shardline.errors import ShardlineError
from tests.cli.test_bad_input import _fails


def test_one_device_or_one_per_stage() -> None:
    assert RunConfig().devices == ("CPU",) and RunConfig().for_stage(1, 3) == RunConfig()
    two = RunConfig(device="CPU,GPU.1")
    assert two.devices == ("CPU", "GPU.1")
    assert [two.for_stage(k, 2).device for k in range(2)] == ["CPU", "GPU.1"]
    assert RunConfig(device="HETERO:GPU,CPU").devices == ("HETERO:GPU,CPU",)  # one device spanning two
    with pytest.raises(ShardlineError, match=r"--device names 2 devices \(CPU,GPU.1\) for 3 stages here"):
        two.for_stage(0, 3)


@pytest.mark.parametrize("device", ["", ",", "CPU,", "CPU, ,GPU", "C PU", "X" * 65])
def test_a_malformed_device_list_is_refused(device: str) -> None:
    with pytest.raises(ShardlineError, match="--device takes one OpenVINO device name, or one per stage"):
        RunConfig(device=device)


def test_a_kv_precision_default_reads_every_device() -> None:
    assert RunConfig(precision="fast", device="CPU,CPU").kv == "f16"
    assert RunConfig(precision="fast", device="CPU,GPU").kv is None  # the GPU's own


def _generate(folder: Path, device: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["generate", "--shards", str(folder), "--raw", "The capital of France is", "--max-tokens", "6",
                 "--device", device]) == 0
    return capsys.readouterr().out


def test_a_device_per_stage_gives_the_same_tokens(shards: Callable[..., Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = shards("fp32", stages=2)
    assert _generate(folder, "CPU,CPU", capsys) == _generate(folder, "CPU", capsys)


@pytest.mark.parametrize("device,message", [
    ("CPU,CPU,CPU", "--device names 3 devices (CPU,CPU,CPU) for 2 stages here: give one device, or one per stage"),
    ("CPU,NOPE", "on NOPE"),
    ("CPU,,CPU", "--device takes one OpenVINO device name, or one per stage"),
])
def test_a_device_list_that_cannot_run_is_one_clear_error(shards: Callable[..., Path], device: str, message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["generate", "--shards", str(shards("fp32", stages=2)), "--raw", "hi", "--device", device],
           message)
