"""A GGUF file's header: its metadata and where each tensor lies, read lazily and checked.

gguf-py's GGUFReader builds numpy views for every element of every array when it opens a file:
for Llama 3's vocabulary (128k tokens, 280k merges) that is ~17 s and hundreds of MB, paid by
every stage's export process. This reader walks the header once with struct, keeps numeric
arrays as numpy views of the mapped file, and decodes string arrays only when asked (the
tokenizer). Every length is checked against the file before it is used, so a truncated or
hostile header is one clear error, never a huge allocation.

Format: llama.cpp's gguf.md (v2/v3): magic, version, tensor and key counts, the key/value
pairs, the tensor infos, then the data at the alignment (general.alignment, default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardline.errors import ShardlineError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first
    kind: str  # GGML type name
    offset: int  # absolute, in the file
    nbytes: int


class _Strings:
    """An array of strings in the mapped file, decoded on first use."""

    def __init__(self, buf: memoryview, start: int, count: int) -> None:
        self._buf, self._start, self.count = buf, start, count
        self._items: list[str] | None = None

    def items(self) -> list[str]:
        if self._items is None:
            out, at = [], self._start
            for _ in range(self.count):
                (n,) = struct.unpack_from("<Q", self._buf, at)
                out.append(bytes(self._buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"))
                at += 8 + n
            self._items = out
        return self._items


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ShardlineError(f"cannot read GGUF file {path}: {e}") from None
        self._buf = memoryview(self._map)
        self._at = 0
        self.fields: dict[str, Any] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise ShardlineError(f"cannot read GGUF file {path}: corrupt or truncated header near byte "
                                 f"{self._at}: {e}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """A key's value: a number, bool or str, or a list for an array (strings decoded now)."""
        if key not in self.fields:
            return default
        value = self.fields[key]
        if isinstance(value, _Strings):
            return value.items()
        if isinstance(value, np.ndarray):
            return value.tolist()
        return value

    # --- parsing ------------------------------------------------------------------------

    def _take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._buf, self._at)
        self._at += size
        return value

    def _need(self, n: int) -> None:
        if n < 0 or self._at + n > len(self._buf):
            raise ValueError(f"{n} bytes wanted, the file ends at {len(self._buf)}")

    def _string(self) -> str:
        n = self._take("<Q")
        self._need(n)
        s = bytes(self._buf[self._at:self._at + n]).decode("utf-8")
        self._at += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        inner, count = self._take("<I"), self._take("<Q")
        if inner in _NUMPY:
            width = np.dtype(_NUMPY[inner]).itemsize
            self._need(count * width)
            a = np.frombuffer(self._buf, dtype=_NUMPY[inner], count=count, offset=self._at)
            self._at += count * width
            return a
        if inner == _STRING:
            start = self._at
            for _ in range(count):  # walk past them; decoded only if asked for
                n = self._take("<Q")
                self._need(n)
                self._at += n
            return _Strings(self._buf, start, count)
        raise ValueError(f"unsupported array element type {inner}")

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._at = 4
        version = self._take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        if align < 1:
            raise ValueError(f"general.alignment {align}")
        base = -(-self._at // align) * align
        self.tensors = [self._placed(name, shape, kind, base + rel) for name, shape, kind, rel in infos]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._take("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        shape = tuple(self._take("<Q") for _ in range(n_dims))
        return name, shape, self._take("<I"), self._take("<Q")

    def _placed(self, name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            t = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown type {kind}") from None
        block, size = GGML_QUANT_SIZES[t]
        n = int(np.prod(shape, dtype=np.int64))
        if shape[0] % block:
            raise ValueError(f"tensor {name}: rows of {shape[0]} are not whole {t.name} blocks")
        nbytes = n // block * size
        if offset + nbytes > len(self._buf):
            raise ValueError(f"tensor {name}'s data ends past the file's end (truncated file?)")
        return TensorInfo(name, shape, t.name, offset, nbytes)
