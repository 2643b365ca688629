"""The folder tree is the architecture: each layer imports only the layers below it.

Lowest first: the base modules (errors, config, host, signals); model/ (the architecture, the
sources, the tokenizer, the shard manifest); wire/ and stage/ and export/ and decoding/; node/
(the stage-worker process); pipeline/ (executes step plans); serving/ (decides them); api/;
cluster/; then server.py (the composition root) and cli.py on top, imported by nothing.
The research tools (tools/shardline_tools: the simulator, the length predictor's training) sit
outside the package: nothing in it imports them. The deciding layers (serving/'s scheduler and
engine, disagg/'s policies) import no OpenVINO, even indirectly.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "kernels": set(),
    "stage": {"model", "decoding", "kernels"},
    "export": {"model", "kernels"},
    "node": {"model", "wire", "stage", "decoding", "kernels"},
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


def _roots(path: Path) -> set[str]:
    """Every top-level package a module imports (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


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


def test_the_package_never_imports_the_research_tools() -> None:
    users = [str(p.relative_to(ROOT)) for p in MODULES if {"shardline_tools", "sklearn"} & _roots(p)]
    assert users == []


# Every module of serving/ and disagg/'s decisions and roles, imported in a fresh interpreter: what
# importing them pulls in, transitively.
PURE = sorted(f"shardline.serving.{p.stem}" for p in (ROOT / "serving").glob("*.py") if p.stem != "__init__") + [
    "shardline.disagg.policies", "shardline.disagg.instance", "shardline.disagg.state", "shardline.disagg.prefill",
    "shardline.disagg.decode", "shardline.disagg.front"]


def test_the_deciding_layers_import_no_openvino() -> None:
    assert "shardline.serving.scheduler" in PURE and "shardline.serving.engine" in PURE
    script = (f"import sys\nimport {', '.join(PURE)}\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'openvino'))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
