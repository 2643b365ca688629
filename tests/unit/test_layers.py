"""The folder tree is the architecture: each layer imports only the layers below it.

Lowest first: the base modules (errors, config, host, signals); model/ (the architecture, the
sources, the tokenizer, the shard manifest); wire/ and stage/ and export/ and decoding/; node/
(the stage-worker process); pipeline/ (executes step plans); serving/ (decides them); api/;
cluster/; then server.py (the composition root) and cli.py on top, imported by nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardline

ROOT = Path(shardline.__file__).parent
BASE = {"errors", "config", "host", "signals", "__init__"}
# What each layer may import from shardline (besides the base modules and itself).
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "wire": set(),
    "decoding": set(),
    "stage": {"model"},
    "export": {"model"},
    "node": {"model", "wire", "stage", "decoding"},
    "pipeline": {"model", "wire", "stage", "decoding", "node"},
    "serving": {"model", "wire", "stage", "decoding", "pipeline"},
    "api": {"model", "serving"},
    "cluster": {"model", "wire", "stage", "decoding", "export", "node"},
    "disagg": {"model", "wire", "stage", "decoding", "pipeline", "serving"},
    "server": {"model", "stage", "pipeline", "serving", "api", "wire", "disagg"},
    "cli": {"model", "export", "pipeline", "serving", "api", "cluster", "node", "server", "decoding", "wire"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """The shardline layers a module imports (at any depth of the module, lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "shardline"]
        for name in names:
            parts = name.split(".")
            if parts[0] == "shardline" and len(parts) > 1:
                found.add(parts[1])
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_the_layers_below_it(path: Path) -> None:
    layer = _layer(path)
    if layer in BASE:
        assert _imports(path) <= BASE, f"{path.name}: the base imports only the base"
        return
    assert layer in ALLOWED, f"{layer}: a new layer; place it in ALLOWED and in docs/structure.md"
    wrong = _imports(path) - BASE - ALLOWED[layer] - {layer}
    assert not wrong, f"{path.relative_to(ROOT)} ({layer}) imports {sorted(wrong)}"


def test_nothing_imports_the_cli_and_only_the_roots_know_every_layer() -> None:
    for path in MODULES:
        assert "cli" not in _imports(path), f"{path.relative_to(ROOT)} imports cli"
    both = [p.relative_to(ROOT) for p in MODULES if {"api", "pipeline"} <= _imports(p)]
    assert [str(p) for p in both] == ["server.py"]


def test_the_checker_sees_lazy_imports() -> None:
    """A function-level import counts as much as a top-level one (else the rules leak)."""
    assert "export" in _imports(ROOT / "cli.py")
