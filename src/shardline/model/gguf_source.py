"""GGUF files (llama.cpp's format): metadata -> Arch, tensors as stored or as f32, tokenizer.

A file is checked whole when it is opened (every tensor the model needs, with its shape and a
known type; the vocabulary against the embedding; split parts), so a bad file is one clear
error before anything is written. Tensors are read with plain reads, one at a time: a stage's
export holds that stage's weights, never the file's pages.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.families.base import HEAD_NORMS
from shardline.model.gguf_blocks import BLOCK_TYPES, KEPT_TYPES, block_bytes, unpack
from shardline.model.gguf_file import GGUFFile, TensorInfo
from shardline.model.gguf_meta import gguf_arch, gguf_family
from shardline.model.quant import Blocks, GroupQuant, HalfFloat, Stored
from shardline.model.source import file_sha256

# GGUF tensor name (per layer or global) -> Hugging Face name.
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "self_attn.post_norm.weight",
    "post_ffw_norm.weight": "mlp.post_norm.weight",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) < 3:
        return None
    rest = ".".join(parts[2:])
    if rest in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[rest]}"
    base, _, kind = rest.rpartition(".")
    if base in _LAYER and kind in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER[base]}.{kind}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved for its rotary kernel).

    llama.cpp's converter reorders each head's rows from halves [x0..x31 | x32..x63] to
    interleaved pairs; HF layout (rotate_half RoPE) needs the halves back. Only rows move, so
    a matrix's blocks (along its input dimension) stay whole.
    """
    rows = w.shape[0]
    head = rows // n_heads
    return w.reshape(n_heads, head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Tensor:
    """Where one tensor lies: its file, offset, type and shape [rows, cols] (GGUF's ne1, ne0)."""

    def __init__(self, path: Path, t: TensorInfo) -> None:
        self.path, self.kind = path, t.kind
        self.offset, self.nbytes = t.offset, t.nbytes
        self.shape = tuple(reversed(t.shape))

    def raw(self) -> np.ndarray:
        return self._read(self.offset, self.nbytes)

    @property
    def matrix_rows(self) -> int:
        """Rows as a matrix: a 3-D tensor's (experts) stacked, [experts * rows, cols]."""
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the tensor's bytes as a matrix, [stop - start, row bytes]."""
        row = self.nbytes // self.matrix_rows
        return self._read(self.offset + start * row, (stop - start) * row).reshape(stop - start, row)

    def _read(self, offset: int, count: int) -> np.ndarray:
        data = np.fromfile(self.path, dtype=np.uint8, count=count, offset=offset)
        if data.size != count:
            raise ShardlineError(f"{self.path.name}: a tensor's data is cut short (truncated file?)")
        return data


class GGUFSource:
    format = "gguf"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parts = split_parts(path)
        readers = [_read(p) for p in self.parts]
        _check_split(self.parts, readers)
        self._file = readers[0]
        self._tensors: dict[str, _Tensor] = {}
        for part, reader in zip(self.parts, readers, strict=True):
            for t in reader.tensors:
                name = hf_name(t.name)
                if name is not None:
                    self._tensors[name] = _Tensor(part, t)
        self.family = gguf_family(self._meta, path.name)
        self.arch = gguf_arch(self._meta, self.family, self._tensors_shape, self._rope_factors(), path.name)
        self._check_tensors()

    def _meta(self, key: str, default: Any = None) -> Any:
        return self._file.get(key, default)

    def _tensors_shape(self, name: str) -> tuple[int, ...] | None:
        t = self._tensors.get(name)
        return None if t is None else t.shape

    def _rope_factors(self) -> tuple[float, ...] | None:
        if "rope_freqs" not in self._tensors:
            return None
        return tuple(float(x) for x in self.tensor("rope_freqs").reshape(-1))

    def _check_tensors(self) -> None:
        a = self.arch
        expect = {"model.embed_tokens.weight": (a.vocab, a.hidden), "model.norm.weight": (a.hidden,)}
        if not a.tied_embeddings:
            expect["lm_head.weight"] = (a.vocab, a.hidden)
        for i in range(a.n_layers):
            expect |= layer_shapes(a, i)
        for name, shape in expect.items():
            t = self._tensors.get(name)
            if t is None:
                raise ShardlineError(f"{self.path.name}: tensor {gguf_name(name)} is missing")
            if t.shape != shape and not (len(shape) == 1 and t.shape == (1, *shape)):
                raise ShardlineError(f"{self.path.name}: tensor {gguf_name(name)} has shape {list(t.shape)}, "
                                     f"expected {list(shape)} for {a.dims()}")
            if t.kind not in _DEQUANTIZABLE:
                raise ShardlineError(f"{self.path.name}: tensor {gguf_name(name)} has type {t.kind}, "
                                     "which shardline cannot read")

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _get(self, name: str) -> _Tensor:
        if name not in self._tensors:
            raise ShardlineError(f"tensor {name} is missing from {self.path.name}")
        return self._tensors[name]

    def _heads_for(self, name: str) -> int | None:
        if not self.family.gguf_qk_permuted or not name.endswith(".weight"):
            return None
        if ".q_proj." in name:
            return self.arch.n_heads
        if ".k_proj." in name:
            return self.arch.n_kv_heads
        return None

    def stored_type(self, name: str) -> str:
        return self._get(name).kind

    def tensor(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._get(name)
        raw = t.raw()
        if t.kind == "F32":
            w = raw.view(np.float32)
        else:
            w = np.asarray(dequantize(raw.reshape(t.shape[0], -1), GGMLQuantizationType[t.kind]), dtype=np.float32)
        w = w.reshape(t.shape) if len(t.shape) in (2, 3) else w.reshape(-1)
        heads = self._heads_for(name)
        return _unpermute_rows(w, heads) if heads else w

    def stored(self, name: str) -> Stored | None:
        t = self._get(name)
        if t.kind == "F32":
            return None
        if t.kind in ("F16", "BF16"):
            s: Stored = HalfFloat(t.kind, t.raw().view(np.uint16).reshape(t.shape))
        elif t.kind in BLOCK_TYPES:
            s = unpack(t.kind, (t.rows, t.matrix_rows, t.nbytes // t.matrix_rows), gguf_name(name))
        else:
            raise ShardlineError(cannot_keep(self.path.name, gguf_name(name), t.kind))
        heads = self._heads_for(name)
        return _permuted(s, heads) if heads else s

    def blocks(self, name: str) -> Blocks | None:
        t = self._get(name)
        if t.kind not in BLOCK_TYPES or len(t.shape) != 2:
            return None
        values, size = block_bytes(t.kind)
        rows, cols = t.shape
        if cols % values or t.nbytes != rows * (cols // values) * size:
            raise ShardlineError(f"{self.path.name}: tensor {gguf_name(name)} holds {t.nbytes} bytes, but {rows} "
                                 f"rows of {cols} {t.kind} values take {rows * (cols // values) * size}")
        data = t.raw().reshape(rows, -1)
        heads = self._heads_for(name)
        return Blocks(t.kind, _unpermute_rows(data, heads) if heads else data, cols)

    def types(self) -> dict[str, int]:
        """How many of the model's tensors the file stores in each type."""
        out: dict[str, int] = {}
        for t in self._tensors.values():
            out[t.kind] = out.get(t.kind, 0) + 1
        return dict(sorted(out.items()))

    def sha256(self) -> str:
        if len(self.parts) == 1:
            return file_sha256(self.path)
        return hashlib.sha256("".join(file_sha256(p) for p in self.parts).encode()).hexdigest()

    def tokenizer_files(self, out: Path) -> None:
        from shardline.model.gguf_tokenizer import write_tokenizer_files

        write_tokenizer_files(self._meta, out)


def cannot_keep(file: str, tensor: str, kind: str) -> str:
    return (f"{file}: tensor {tensor} is {kind}, which --weights gguf cannot keep (kept: {', '.join(KEPT_TYPES)}); "
            "export with --weights fp16, int8 or int4 to re-quantize it from its dequantized values")


_DEQUANTIZABLE = {"F32", "F16", "BF16", *BLOCK_TYPES, "Q8_1", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                  "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"}


def gguf_name(hf: str) -> str:
    """A tensor's name as the file spells it (for messages)."""
    inverse = {v: k for k, v in _GLOBAL.items()}
    if hf in inverse:
        return inverse[hf]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", hf)
    if m:
        layer, rest = m.groups()
        for g, h in _LAYER.items():
            if rest == h:
                return f"blk.{layer}.{g}"
            if rest.startswith(h + "."):
                return f"blk.{layer}.{g}{rest[len(h):]}"
    return hf


def layer_shapes(a: Arch, i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    rows = {"q_proj": (q, a.hidden), "k_proj": (kv, a.hidden), "v_proj": (kv, a.hidden), "o_proj": (a.hidden, q),
            "gate_proj": (a.intermediate, a.hidden), "up_proj": (a.intermediate, a.hidden),
            "down_proj": (a.hidden, a.intermediate)}
    out: dict[str, tuple[int, ...]] = {}
    experts = {"mlp.gate.weight": (a.experts, a.hidden),
               "mlp.experts.gate_proj.weight": (a.experts, a.expert_ffn, a.hidden),
               "mlp.experts.up_proj.weight": (a.experts, a.expert_ffn, a.hidden),
               "mlp.experts.down_proj.weight": (a.experts, a.hidden, a.expert_ffn),
               "mlp.gate.bias": (a.experts,), "mlp.experts.gate_proj.bias": (a.experts, a.expert_ffn),
               "mlp.experts.up_proj.bias": (a.experts, a.expert_ffn),
               "mlp.experts.down_proj.bias": (a.experts, a.hidden), "self_attn.sinks.weight": (a.n_heads,)}
    for name in a.layer_tensors(i):
        short = name[len(p):]
        if short in experts:
            out[name] = experts[short]
            continue
        module, _, kind = short.rpartition(".")
        linear = module.rpartition(".")[2]
        if linear in rows:
            out[name] = rows[linear] if kind == "weight" else (rows[linear][0],)
        elif short in HEAD_NORMS:
            out[name] = (a.head_dim,)
        else:
            out[name] = (a.hidden,)
    return out


def _permuted(s: Stored, heads: int) -> Stored:
    if isinstance(s, HalfFloat):
        return HalfFloat(s.kind, _unpermute_rows(s.bits, heads))

    def rows(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else _unpermute_rows(a, heads)

    return GroupQuant(
        kind=s.kind, packed=_unpermute_rows(s.packed, heads), rows=s.rows, groups=s.groups, group=s.group,
        bits=s.bits, signed=s.signed, zero=s.zero, group_scale=_unpermute_rows(s.group_scale, heads),
        super_scale=rows(s.super_scale), group_min=rows(s.group_min), super_min=rows(s.super_min),
        min_sign=s.min_sign,
    )


def _read(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ShardlineError(f"GGUF part {path.name} is missing (expected beside {path.parent})")
    return GGUFFile(path)


def split_parts(path: Path) -> list[Path]:
    """A split model's parts (-00001-of-0000N.gguf), from its first; a whole file alone."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    no, count = int(m.group("no")), int(m.group("count"))
    if no != 1:
        raise ShardlineError(f"{path.name} is part {no} of {count} of a split model: give its first part")
    return [path.with_name(f"{m.group('stem')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def _check_split(parts: list[Path], readers: list[GGUFFile]) -> None:
    def value(reader: GGUFFile, key: str) -> Any:
        return reader.get(key)

    if len(parts) == 1:
        if (value(readers[0], "split.count") or 1) > 1:
            raise ShardlineError(f"{parts[0].name} is one part of a split model but is not named like one "
                                 "(NAME-00001-of-0000N.gguf)")
        return
    total = sum(len(r.tensors) for r in readers)
    for k, (part, reader) in enumerate(zip(parts, readers, strict=True)):
        if value(reader, "split.no") != k or value(reader, "split.count") != len(parts):
            raise ShardlineError(f"{part.name}: its split metadata says part {value(reader, 'split.no')} of "
                                 f"{value(reader, 'split.count')}, expected {k} of {len(parts)}")
    expected = value(readers[0], "split.tensors.count")
    if expected != total:
        raise ShardlineError(f"{parts[0].name}: the parts hold {total} tensors, the first says {expected}")
