"""Issue 54 point 1, the audit's triggers through a real server: `shardline serve` on the default
model's paged export, in one process and over 2 paged workers. Grammars that cannot be followed,
sent beside 8 plain requests, 20 rounds: each broken request is a 400 naming its own field and
carrying nothing of anyone else's; every plain answer equals the answer of a round without them
(the audit saw every plain completion in flight end in a 500 that carried the bad grammar)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.conftest import DEFAULT_SPLIT
from tests.multiproc.procs import Proc, serve, workers_of

MODEL = "m"
ROUNDS = 20
# Each broken request plants its own string; none may come back to anyone else.
NOTHING = 'root ::= x\nx ::= x "PLANTED-1"'  # the audit's: a grammar that allows nothing
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a",
        "description": "PLANTED-2"}  # the audit's: $defs that refer to each other in a loop
LATER = 'root ::= "a" x\nx ::= x "PLANTED-3"'  # one token allowed, then nothing
PLAIN = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is blue because",
         "What is the capital of Italy?", "Name a red fruit.", "Say hello in German.", "What is 3 + 4?"]


def _plain(i: int) -> tuple[str, dict[str, Any]]:
    if i < 4:
        return "completions", {"model": MODEL, "prompt": PLAIN[i], "max_tokens": 6, "temperature": 0}
    return "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PLAIN[i]}],
                                "max_tokens": 6, "temperature": 0}


BROKEN: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 6, "grammar": NOTHING}, "grammar"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": LOOP}}},
     "response_format"),
    ("completions", {"model": MODEL, "prompt": "y", "max_tokens": 6, "grammar": LATER}, "grammar"),
]


@pytest.fixture(scope="module")
def default_export(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers=DEFAULT_SPLIT, paged=True)


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers="0-9,10-19,20-29", paged=True)


@pytest.fixture(scope="module", params=["default", "workers"])
def server(request: pytest.FixtureRequest, default_export: Path, three: Path) -> Iterator[Proc]:
    common = ["--port", "0", "--model-id", MODEL, "--max-streams", "16"]
    if request.param == "default":
        with serve(["--shards", str(default_export), *common]) as s:
            yield s
        return
    with workers_of(three, "1", "2") as ws, \
            serve(["--shards", str(three), "--workers", ",".join(w.addr for w in ws), "--insecure", *common]) as s:
        yield s


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, timeout=120)


def _text(r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def _round(url: str, broken: bool) -> tuple[list[str], list[httpx.Response]]:
    """The 8 plain requests at once (with the broken ones between them): their texts, and the
    broken ones' responses."""
    jobs = [_plain(i) for i in range(len(PLAIN))]
    bad = [(path, body) for path, body, _ in BROKEN] if broken else []
    with ThreadPoolExecutor(len(jobs) + len(bad)) as pool:
        futures = [pool.submit(_post, url, p, b) for p, b in [*jobs[:4], *bad, *jobs[4:]]]
        got = [f.result() for f in futures]
    plain, failed = got[:4] + got[4 + len(bad):], got[4:4 + len(bad)]
    for r in plain:
        assert r.status_code == 200, r.text
        assert "PLANTED" not in r.text
    return [_text(r) for r in plain], failed


def test_broken_grammars_fail_alone_for_20_rounds(server: Proc) -> None:
    url = server.addr
    want, _ = _round(url, broken=False)
    assert all(want)
    for _ in range(ROUNDS):
        texts, failed = _round(url, broken=True)
        assert texts == want
        for i, (r, (_, _, param)) in enumerate(zip(failed, BROKEN, strict=True)):
            error = r.json()["error"]
            assert (r.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error"), r.text
            others = {f"PLANTED-{j + 1}" for j in range(len(BROKEN)) if j != i}
            assert not any(o in json.dumps(error) for o in others), r.text
    assert httpx.get(f"{url.removesuffix('/v1')}/health").json()["status"] == "ok"
