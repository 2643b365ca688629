"""Session fixtures: the default model is exported once per configuration per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

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
    """exported(weights, stages=None, layers=None, model=None) -> folder, cached for the session."""
    made: dict[tuple[object, ...], Path] = {}
    root = tmp_path_factory.mktemp("shards")

    def exported(weights: str, stages: int | None = None, layers: str | None = None,
                 model: Path | None = None, group_size: int = 64) -> Path:
        key = (weights, stages, layers, model, group_size)
        if key not in made:
            name = f"{weights}-{stages or layers}-{abs(hash(key)) % 10**8}"
            made[key] = __import__("shardline.export.exporter", fromlist=["export"]).export(
                ExportConfig(out=root / name, model=model, stages=stages, layers=layers, weights=weights,
                             group_size=group_size, isolate=False, progress=False)
            )
        return made[key]

    return exported
