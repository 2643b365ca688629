"""Session fixtures: the default model is exported once per configuration per test session, and
the session fails if a test left a process running."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from shardline.config import ExportConfig

os.environ.setdefault("OMP_NUM_THREADS", "2")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """exported(weights, stages=None, layers=None, model=None, paged=False) -> folder, cached for the session."""
    made: dict[tuple[object, ...], Path] = {}
    root = tmp_path_factory.mktemp("shards")

    def exported(weights: str, stages: int | None = None, layers: str | None = None,
                 model: Path | None = None, group_size: int = 64, paged: bool = False) -> Path:
        key = (weights, stages, layers, model, group_size, paged)
        if key not in made:
            name = f"{weights}-{stages or layers}-{abs(hash(key)) % 10**8}"
            made[key] = __import__("shardline.export.exporter", fromlist=["export"]).export(
                ExportConfig(out=root / name, model=model, stages=stages, layers=layers, weights=weights,
                             group_size=group_size, paged=paged, isolate=False, progress=False)
            )
        return made[key]

    return exported


# The default export's split (2 stages balanced by work): the bundled length predictor fits it.
DEFAULT_SPLIT = "0-18,19-29"


@pytest.fixture(scope="session")
def balanced(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers=DEFAULT_SPLIT)


# Children the test process keeps until it exits, by design: multiprocessing's resource tracker,
# started by the first spawn-context pool (the exporter's per-stage processes, `isolate=True`),
# shared by every later pool and stopped only when this process exits. Nothing else is tolerated.
NOT_LEAKS = ("from multiprocessing.resource_tracker import main",)
LEAK_GRACE_S = 3.0  # for a process a test signalled but did not wait for


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """After the last test, once every other fixture is torn down (this one is set up first):
    kill any process the tests left running and fail the session, naming each by command line."""
    yield
    if left := _kill_leftovers():
        named = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"{len(left)} process(es) left running by the tests (now killed):\n{named}", pytrace=False)


def _kill_leftovers() -> dict[int, str]:
    """This process's descendants still running after a grace period (now killed), by pid."""
    listed = {p: _command(p) for p in psutil.Process().children(recursive=True)}
    suspects = [p for p, cmd in listed.items() if not any(ok in cmd for ok in NOT_LEAKS)]
    _, alive = psutil.wait_procs(suspects, timeout=LEAK_GRACE_S)  # reaps those that are exiting
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    return {p.pid: listed[p] for p in alive}


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:  # exited (or a zombie) since it was listed
        return f"<exited, pid {p.pid}>"


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): the tiny Hugging Face folders of tests/tiny.py (shared SmolLM2 tokenizer)."""
    from tests.tiny import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_models(tiny_sources: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_shards, draft_shards): the tiny pair exported once per session, one fp32 stage each."""
    from shardline.export.exporter import export

    root = tmp_path_factory.mktemp("tiny-shards")
    return (
        export(ExportConfig(out=root / "target", model=tiny_sources[0], stages=1, weights="fp32",
                            isolate=False, progress=False)),
        export(ExportConfig(out=root / "draft", model=tiny_sources[1], stages=1, weights="fp32",
                            isolate=False, progress=False)),
    )
