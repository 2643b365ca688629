"""`shardline keygen`, and the flags that choose how links and the API are secured: refused
with one clear line when they are missing, contradictory, or point at nothing usable."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from shardline.cli import main
from tests.cli.test_bad_input import _fails


def test_keygen_makes_a_ca_and_private_node_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "creds"
    assert main(["keygen", "--out", str(out), "--nodes", "2"]) == 0
    assert capsys.readouterr().out.split() == [str(out / "node-0"), str(out / "node-1")]
    assert sorted(p.name for p in out.iterdir()) == ["ca-key.pem", "ca.pem", "node-0", "node-1"]
    for node in ("node-0", "node-1"):
        assert sorted(p.name for p in (out / node).iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
        assert stat.S_IMODE((out / node / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca-key.pem").stat().st_mode) == 0o600
    before = (out / "ca.pem").read_bytes()
    _fails(capsys, ["keygen", "--out", str(out)], f"{out} already holds a cluster CA; choose another --out")
    assert (out / "ca.pem").read_bytes() == before  # nothing overwritten


@pytest.mark.parametrize("nodes", ["0", "1001"])
def test_keygen_node_count_in_range(tmp_path: Path, nodes: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["keygen", "--out", str(tmp_path / "c"), "--nodes", nodes], f"--nodes must be 1-1000, got {nodes}")
    assert not (tmp_path / "c").exists()


def test_a_worker_needs_credentials_or_an_explicit_insecure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["worker", "--shards", str(tmp_path), "--stage", "1"],
           "links between nodes are mutual TLS: give --credentials DIR")


def test_generate_on_workers_needs_them_too(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _fails(capsys, ["generate", "--shards", str(tmp_path), "--workers", "127.0.0.1:1", "hi"],
           "or --insecure to run them in clear")


@pytest.mark.parametrize("case", ["both", "missing", "corrupt"])
def test_bad_credentials(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    creds = tmp_path / "creds"
    assert main(["keygen", "--out", str(creds), "--nodes", "1"]) == 0
    node = creds / "node-0"
    argv = ["worker", "--shards", str(tmp_path), "--stage", "1", "--credentials", str(node)]
    if case == "both":
        return _fails(capsys, [*argv, "--insecure"], "--credentials and --insecure exclude each other")
    if case == "missing":
        (node / "key.pem").unlink()
        return _fails(capsys, argv, f"credentials {node}: no key.pem (make them with `shardline keygen`)")
    (node / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    _fails(capsys, argv, f"credentials {node}: ")


@pytest.mark.parametrize("key,message", [
    ("short", "the API key must be at least 8 printable ASCII characters"),
    ("with a\ttab", "the API key must be at least 8 printable ASCII characters"),
])
def test_bad_api_keys(tmp_path: Path, key: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["serve", "--shards", str(tmp_path), "--api-key", key], message)


@pytest.mark.parametrize("text", ["", "\n\n", "sk-good-0123456789\nshort\n", "sk-good-0123456789\nwith a\ttab\n"])
def test_an_api_key_file_with_a_bad_key_among_its_lines(tmp_path: Path, text: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keys").write_text(text)
    _fails(capsys, ["serve", "--shards", str(tmp_path), "--api-key-file", str(tmp_path / "keys")],
           "the API key must be at least 8 printable ASCII characters")


def test_an_api_key_file_that_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["serve", "--shards", str(tmp_path), "--api-key-file", str(tmp_path / "nope")],
           f"--api-key-file {tmp_path / 'nope'}: [Errno 2] No such file or directory")


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/", "http://a.b/path", "ftp://x", "",
                                    "http://x y"])
def test_a_cors_origin_that_is_not_one_is_refused(tmp_path: Path, origin: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["serve", "--shards", str(tmp_path), "--cors-origin", origin],
           f"--cors-origin must be '*' or SCHEME://HOST[:PORT] with no path, got {origin!r}")
