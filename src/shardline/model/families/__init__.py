"""The architectures shardline builds, by name, GGUF architecture and Hugging Face model type.

Adding one is one module in this package: it declares its Family (its names, its tensors, its
layer written in LayerOps) in a module-level `FAMILIES` tuple, and is found here by itself.
"""

from __future__ import annotations

import importlib
import pkgutil

from shardline.errors import ShardlineError
from shardline.model.families.base import LINEARS, Family, LayerOps
from shardline.model.families.refused import REFUSED


def _discovered() -> dict[str, Family]:
    """Every Family the package's modules declare, by name (each name once)."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for f in getattr(module, "FAMILIES", ()):
            if f.name in found:
                raise ShardlineError(f"architecture {f.name!r} is declared twice ({info.name})")
            found[f.name] = f
    return found


FAMILIES: dict[str, Family] = _discovered()

__all__ = ["FAMILIES", "LINEARS", "Family", "LayerOps", "family", "for_gguf", "for_hf"]


def _supported() -> str:
    gguf = sorted({a for f in FAMILIES.values() for a in f.gguf_archs})
    hf = sorted({t for f in FAMILIES.values() for t in f.hf_model_types})
    return f"GGUF architectures {', '.join(gguf)}; Hugging Face model types {', '.join(hf)}"


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ShardlineError(f"unsupported architecture {name!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_gguf(arch: str, where: str, experts: int = 0) -> Family:
    """The family of a file of `arch` with `experts` experts per layer (0: a dense MLP)."""
    for f in FAMILIES.values():
        if arch in f.gguf_archs:
            return family(f.with_experts) if experts > 0 and f.with_experts else f
    if arch in REFUSED:
        raise ShardlineError(f"{where}: architecture {arch!r} is not supported: {REFUSED[arch]}")
    raise ShardlineError(f"unsupported architecture {arch!r} in {where}; supported: {_supported()}")


def for_hf(model_type: str, where: str) -> Family:
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    raise ShardlineError(f"unsupported architecture {model_type!r} in {where}; supported: {_supported()}")
