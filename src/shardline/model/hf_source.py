"""Hugging Face folders: config.json, *.safetensors (read lazily, tensor by tensor), tokenizer.json."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.source import QuantBlocks

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
        self.arch = Arch.from_hf_config(self.config)
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

    def blocks(self, name: str) -> QuantBlocks | None:
        return None

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
