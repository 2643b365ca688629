"""The architectures shardline builds, by name, GGUF architecture and Hugging Face model type.

Adding one: a module here with its Family, and a line in FAMILIES.
"""

from __future__ import annotations

from shardline.errors import ShardlineError
from shardline.model.families.base import LINEARS, Family, LayerOps
from shardline.model.families.llama import LLAMA, MISTRAL
from shardline.model.families.qwen2 import QWEN2

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2)}

__all__ = ["FAMILIES", "LINEARS", "Family", "LayerOps", "family", "for_gguf", "for_hf"]


def _supported() -> str:
    gguf = sorted({a for f in FAMILIES.values() for a in f.gguf_archs})
    hf = sorted({t for f in FAMILIES.values() for t in f.hf_model_types})
    return f"GGUF architectures {', '.join(gguf)}; Hugging Face model types {', '.join(hf)}"


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ShardlineError(f"unsupported architecture {name!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_gguf(arch: str, where: str) -> Family:
    for f in FAMILIES.values():
        if arch in f.gguf_archs:
            return f
    raise ShardlineError(f"unsupported architecture {arch!r} in {where}; supported: {_supported()}")


def for_hf(model_type: str, where: str) -> Family:
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    raise ShardlineError(f"unsupported architecture {model_type!r} in {where}; supported: {_supported()}")
