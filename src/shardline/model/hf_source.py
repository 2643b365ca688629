"""Hugging Face folders: config.json, *.safetensors (read lazily, tensor by tensor), tokenizer.json."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from shardline.errors import ShardlineError
from shardline.model import families
from shardline.model.arch import Arch
from shardline.model.quant import Blocks, Stored
from shardline.model.source import source_sha256

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class _SafeTensors:
    """Minimal lazy reader: the header is JSON, the data is memory-mapped and sliced per tensor.

    (numpy has no bfloat16, so bf16 tensors are read as uint16 and widened by hand.)
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header: dict[str, Any] = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self._base = 8 + n

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ShardlineError(f"{self.path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._base + start, shape=(end - start,))
        a = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(a, dtype=np.float32)


class HFSource:
    format = "hf"

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.config: dict[str, Any] = json.loads((path / "config.json").read_text())
        except ValueError as e:
            raise ShardlineError(f"corrupt config.json in {path}: {e}") from None
        self.arch = hf_arch(self.config, f"{path / 'config.json'}")
        self._where: dict[str, _SafeTensors] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ShardlineError(f"no .safetensors files in {path}")
        for f in files:
            st = _SafeTensors(f)
            for name in st.header:
                self._where[name] = st

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ShardlineError(f"tensor {name} is missing from {self.path}")
        return self._where[name].read(name)

    def stored(self, name: str) -> Stored | None:
        return None

    def blocks(self, name: str) -> Blocks | None:
        return None

    def stored_type(self, name: str) -> str:
        return "F32"

    def sha256(self) -> str:
        return source_sha256(self.path)

    def types(self) -> dict[str, int]:
        return {}

    def tokenizer_files(self, out: Path) -> None:
        src = self.path / "tokenizer.json"
        if not src.is_file():
            raise ShardlineError(f"{self.path} has no tokenizer.json")
        shutil.copyfile(src, out / "tokenizer.json")
        cfg_path = self.path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if (self.path / "chat_template.jinja").is_file():
            template = (self.path / "chat_template.jinja").read_text()
        out_cfg = {
            "chat_template": template,
            "bos_token": _token_text(cfg.get("bos_token")),
            "eos_token": _token_text(cfg.get("eos_token")) or "</s>",
            "add_bos_token": bool(cfg.get("add_bos_token", False)),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(out_cfg, indent=1))


def _token_text(t: Any) -> str:
    if isinstance(t, dict):
        return str(t.get("content", ""))
    return "" if t is None else str(t)


def hf_arch(cfg: dict[str, Any], where: str) -> Arch:
    """An Arch from a Hugging Face config.json."""
    fam = families.for_hf(str(cfg.get("model_type", "?")), where)
    if cfg.get("num_local_experts") or cfg.get("num_experts"):
        raise ShardlineError(f"{where}: mixture-of-experts models are not supported")
    try:
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = _hf_rope(cfg)
        context = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window is not None and int(window) < context:
            context = int(window)  # sliding attention equals full attention within its window
        return Arch(
            family=fam.name,
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            rope_theta=float(rope.pop("theta")),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context=context,
            biases=fam.hf_biases(cfg),
            sliding_window=None if window is None else int(window),
            **rope,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ShardlineError(f"{where}: incomplete or malformed config: {type(e).__name__}: {e}") from None


def _hf_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """theta and the scaling fields of Arch, from rope_scaling (or transformers 5's rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    out: dict[str, Any] = {"theta": cfg.get("rope_theta", params.get("rope_theta", 10000.0))}
    if kind in (None, "default"):
        return out
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        out["rope_llama3"] = {k: float(scaling[k]) for k in keys}
        return out
    if kind == "linear":
        out["rope_linear"] = float(scaling["factor"])
        return out
    raise ShardlineError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
