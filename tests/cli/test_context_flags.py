"""`--context` and `--kv-precision` on generate, serve and worker through the real command line:
hostile values get one clear error line and exit 1 (argparse's own exit 2 for a name it does
not know); values in range serve (issue 22 point 1)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from shardline.cli import main
from tests.cli.test_bad_input import SHARDLINE, _fails

BAD_CONTEXTS = [
    (["--context", "0"], "--context must be in 1-16777216 tokens, got 0"),
    (["--context", "-5"], "--context must be in 1-16777216 tokens, got -5"),
    (["--context", "2049"], "--context 2049: it must be in 1-2048, the model's (or its export's) context"),
    (["--context", str(1 << 40)], "--context must be in 1-16777216 tokens"),
]


@pytest.mark.parametrize("flags,message", BAD_CONTEXTS)
def test_generate_refuses_a_context_out_of_range(tiny_models: tuple[Path, Path], flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["generate", "--shards", str(tiny_models[0]), "--raw", "hi", *flags], message)


@pytest.mark.parametrize("flags,message", BAD_CONTEXTS[::2])
def test_serve_refuses_a_context_out_of_range_before_it_binds(tiny_models: tuple[Path, Path], flags: list[str],
                                                              message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["serve", "--shards", str(tiny_models[0]), "--port", "0", *flags], message)


def test_a_worker_refuses_a_context_past_the_models(tiny_sources: tuple[Path, Path],
                                                    shards: Callable[..., Path]) -> None:
    folder = shards("fp32", stages=2, model=tiny_sources[0])
    run = subprocess.run([SHARDLINE, "worker", "--shards", str(folder), "--stage", "1", "--insecure",
                          "--context", "4096"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "shardline: error: --context 4096: it must be in 1-2048, the model's (or its export's) context")


@pytest.mark.parametrize("command", ["generate", "serve", "worker"])
def test_an_unknown_kv_precision_is_refused_by_name(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--kv-precision", "i8"] + (["x"] if command == "generate" else []))
    assert e.value.code == 2
    assert "argument --kv-precision: invalid choice: 'i8' (choose from 'f32', 'f16', 'u8')" in capsys.readouterr().err


def test_a_device_that_cannot_hold_the_kv_cache_is_named(tiny_models: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """This machine has only a CPU: a stage asked of another device fails naming it and the cache."""
    _fails(capsys, ["generate", "--shards", str(tiny_models[0]), "--raw", "hi", "--device", "NPU",
                    "--kv-precision", "u8"], "on NPU with a u8 KV cache")


def test_a_prompt_past_the_context_asked_for_is_refused(tiny_models: tuple[Path, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["generate", "--shards", str(tiny_models[0]), "--raw", "hello there", "--max-tokens", "16",
                    "--context", "8"], "plus 16 new tokens exceeds the context of 8")


@pytest.mark.parametrize("kv", ["f32", "f16", "u8"])
def test_generate_runs_with_each_kv_precision(tiny_models: tuple[Path, Path], kv: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--shards", str(tiny_models[0]), "--raw", "hello", "--max-tokens", "4",
                 "--context", "64", "--kv-precision", kv]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1
