"""`serve --prefill-budget` and `--prefill-share` (issue 23), `--chat-template` (issue 40) and
`export --reblock` (issue 22) through the real command line: a zero, negative or out-of-range
value, or a template that cannot be read, is one clear error line and exit 1, before the server
binds or an export begins."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_bad_input import _fails


@pytest.mark.parametrize("flags,message", [
    (["--prefill-budget", "0"], "--prefill-budget must be in (0, 100] decode steps, got 0.0"),
    (["--prefill-budget", "-1"], "--prefill-budget must be in (0, 100] decode steps, got -1.0"),
    (["--prefill-budget", "1e9"], "--prefill-budget must be in (0, 100] decode steps, got 1000000000.0"),
    (["--prefill-share", "0"], "--prefill-share must be in (0, 1), got 0.0"),
    (["--prefill-share", "-0.5"], "--prefill-share must be in (0, 1), got -0.5"),
    (["--prefill-share", "1"], "--prefill-share must be in (0, 1), got 1.0"),
    (["--prefill-share", "nan"], "--prefill-share must be in (0, 1), got nan"),
])
def test_serve_refuses_a_bad_prefill_pacing(tiny_models: tuple[Path, Path], flags: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["serve", "--shards", str(tiny_models[0]), "--port", "0", *flags], message)


@pytest.mark.parametrize("flags,message", [
    (["--reblock", "0"], "--reblock takes a group size that is a multiple of 16 (e.g. 128), got 0"),
    (["--reblock", "-128"], "--reblock takes a group size that is a multiple of 16 (e.g. 128), got -128"),
    (["--reblock", "100"], "--reblock takes a group size that is a multiple of 16 (e.g. 128), got 100"),
    (["--reblock", "128", "--weights", "int8"], "--reblock re-quantizes a GGUF's own blocks: it needs --weights "
                                                "gguf, not int8"),
])
def test_export_refuses_a_bad_reblock(tmp_path: Path, flags: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["export", "--stages", "1", "--out", str(tmp_path / "out"), *flags], message)
    assert not (tmp_path / "out").exists()


def test_serve_refuses_a_chat_template_it_cannot_read(tiny_models: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jinja"
    _fails(capsys, ["serve", "--shards", str(tiny_models[0]), "--port", "0", "--chat-template", str(missing)],
           f"--chat-template {missing}: neither a built-in (chatml-tools) nor a readable file")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    _fails(capsys, ["serve", "--shards", str(tiny_models[0]), "--port", "0", "--chat-template", str(broken)],
           f"--chat-template {broken}: not a Jinja template")
