"""GGUF's block-quantized types taken apart into a GroupQuant: codes, scales and mins, bit for bit.

Each type's layout is llama.cpp's (ggml-common.h; gguf-py's quants.py reads the same), one
block per 32 values (legacy types) or 256 (K-quants). Rows are unpacked a chunk at a time, so
a large tensor needs only its packed result and a bounded working set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.quant import GroupQuant, pack_codes

_CHUNK_BYTES = 1 << 20  # raw bytes unpacked at a time (its temporaries are a few times this)


@dataclass(frozen=True)
class _Layout:
    block: int  # values per block
    size: int  # bytes per block
    group: int  # values per group (one scale, maybe one min)
    bits: int  # code width stored (the file's, widened to 2, 4 or 8)
    zero: int = 0
    signed: bool = False
    has_super: bool = False  # an f16 super-block scale (K-quants)
    has_min: bool = False
    min_sign: int = 1


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at:at + 2].copy().view(np.float16)[:, 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(words: np.ndarray, n: int) -> np.ndarray:
    """[nb, bytes] -> [nb, n, 8*bytes//n]... the i-th bit plane of every byte: (b >> i) & 1."""
    return np.stack([(words >> np.uint8(i)) & 1 for i in range(n)], axis=1)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(b[:, 2:]), _f16(b, 0)


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of fifth bits, a little-endian u32: bit j belongs to value j."""
    word = qh.copy().view("<u4")[:, 0]
    return ((word[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(b[:, 6:]) | (_q5_high(b[:, 2:6]) << 4), _f16(b, 0)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(b[:, 8:]) | (_q5_high(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return b[:, 2:].view(np.int8), _f16(b, 0)


def _crumbs(qs: np.ndarray, halves: int) -> np.ndarray:
    """2-bit fields: qs [nb, 32*halves]; value h*128 + s*32 + l is (qs[h*32 + l] >> 2s) & 3."""
    q = qs.reshape(-1, halves, 1, 32) >> (np.arange(4, dtype=np.uint8) * 2).reshape(1, 1, 4, 1)
    return (q & 3).reshape(-1, halves * 128)


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    sc = b[:, :16]
    return _crumbs(b[:, 16:80], 2), _f16(b, 80), sc & 0x0F, _f16(b, 82), sc >> 4


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    # value j*32 + l has its high bit in bit j of hmask[l]; a set bit means no -4 (stored: +4).
    high = _bits(b[:, :32], 8).reshape(-1, 256)
    codes = _crumbs(b[:, 32:96], 2) | (high << 2)  # q + 4, 0..7
    s = b[:, 96:108]
    low = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=-1)  # 16 low nibbles
    top = np.concatenate([(s[:, 8:12] >> (2 * i)) & 3 for i in range(4)], axis=-1)  # 16 high pairs
    return codes, _f16(b, 108), ((low | (top << 4)).astype(np.int16) - 32).astype(np.int8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k_codes(qs: np.ndarray) -> np.ndarray:
    """128 bytes: value c*64 + n*32 + l is nibble n (low first) of qs[c*32 + l]."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    sc, mn = _k_scales(b[:, 4:16])
    return _q4_k_codes(b[:, 16:144]), _f16(b, 0), sc, _f16(b, 2), mn


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    sc, mn = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48], 8).reshape(-1, 256)  # value j*32 + l: bit j of qh[l]
    return _q4_k_codes(b[:, 48:176]) | (high << 4), _f16(b, 0), sc, _f16(b, 2), mn


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (ql & 0x0F).reshape(-1, 256)  # value h*128 + n*64 + l: nibble n of ql[h*64 + l]
    return low | (_crumbs(b[:, 128:192], 2) << 4), _f16(b, 208), b[:, 192:208].view(np.int8)


# MXFP4's e2m1 values, doubled to whole numbers (ggml's kvalues_mxfp4): code i stands for MXFP4_VALUES[i]
# times half the block's e8m0 scale, so as int8 codes with an f32 scale per 32 a block is exact.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """Half of 2^(e - 127) as f32, exactly (ggml's GGML_E8M0_TO_FP32_HALF; e < 2: subnormal)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return MXFP4_VALUES[_nibbles(b[:, 1:])], _e8m0_half(b[:, 0])


# type -> (layout, unpack). An unpacker returns (codes [nb, block], then the per-block fields:
# legacy: d [, m]; K-quants: d, sub-scales [, dmin, sub-mins]).
_TYPES: dict[str, tuple[_Layout, Callable[[np.ndarray], tuple[np.ndarray, ...]]]] = {
    "Q4_0": (_Layout(32, 18, 32, 4, zero=8), _q4_0),
    "Q4_1": (_Layout(32, 20, 32, 4, has_min=True), _q4_1),
    "Q5_0": (_Layout(32, 22, 32, 8, zero=16), _q5_0),
    "Q5_1": (_Layout(32, 24, 32, 8, has_min=True), _q5_1),
    "Q8_0": (_Layout(32, 34, 32, 8, signed=True), _q8_0),
    "Q2_K": (_Layout(256, 84, 16, 2, has_super=True, has_min=True, min_sign=-1), _q2_k),
    "Q3_K": (_Layout(256, 110, 16, 4, zero=4, has_super=True), _q3_k),
    "Q4_K": (_Layout(256, 144, 32, 4, has_super=True, has_min=True, min_sign=-1), _q4_k),
    "Q5_K": (_Layout(256, 176, 32, 8, has_super=True, has_min=True, min_sign=-1), _q5_k),
    "Q6_K": (_Layout(256, 210, 16, 8, zero=32, has_super=True), _q6_k),
    "MXFP4": (_Layout(32, 17, 32, 8, signed=True), _mxfp4),
}
BLOCK_TYPES = tuple(_TYPES)
KEPT_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)  # what --weights gguf keeps as the file has it


def block_bytes(kind: str) -> tuple[int, int]:
    """(values, bytes) of one block of `kind`."""
    layout = _TYPES[kind][0]
    return layout.block, layout.size


Rows = Callable[[int, int], np.ndarray]  # (start, stop) -> uint8 [stop - start, row bytes]


def unpack(kind: str, raw: np.ndarray | tuple[Rows, int, int], name: str) -> GroupQuant:
    """raw: uint8 [rows, row bytes] exactly as the file stores the tensor, or (read, rows, row
    bytes) to read it a chunk of rows at a time (then only one chunk of raw bytes is held)."""
    if kind not in _TYPES:
        raise ShardlineError(f"tensor {name}: type {kind} cannot be kept as blocks")
    layout, fn = _TYPES[kind]
    if isinstance(raw, np.ndarray):
        if raw.ndim != 2:
            raise ShardlineError(f"tensor {name}: {raw.ndim} dimensions, expected rows of blocks")
        array = raw
        read, rows, row_bytes = (lambda a, b: array[a:b]), raw.shape[0], raw.shape[1]
    else:
        read, rows, row_bytes = raw
    if row_bytes % layout.size:
        raise ShardlineError(f"tensor {name}: {row_bytes} bytes per row is not a whole number of {kind} blocks")
    per_row = row_bytes // layout.size  # blocks per row
    groups = per_row * layout.block // layout.group
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    out: list[np.ndarray] = []
    for r in range(0, rows, step):  # into arrays made once: no concatenation of the parts
        part = _unpack_rows(fn, layout, np.ascontiguousarray(read(r, min(r + step, rows))), per_row)
        if not out:
            out = [np.empty((rows, *a.shape[1:]), dtype=a.dtype) for a in part]
        for whole, a in zip(out, part, strict=True):
            whole[r:r + len(a)] = a
    packed, fields = out[0], out[1:]
    d, sc = fields[0], fields[1] if layout.has_super else fields[0]
    return GroupQuant(
        kind=kind, packed=packed, rows=rows, groups=groups, group=layout.group, bits=layout.bits,
        signed=layout.signed, zero=layout.zero,
        group_scale=sc if layout.has_super else d,
        super_scale=d if layout.has_super else None,
        group_min=(fields[3] if layout.has_super else fields[1]) if layout.has_min else None,
        super_min=fields[2] if layout.has_super and layout.has_min else None,
        min_sign=layout.min_sign,
    )


def _unpack_rows(fn: Callable[[np.ndarray], tuple[np.ndarray, ...]], layout: _Layout, raw: np.ndarray,
                 per_row: int) -> list[np.ndarray]:
    rows = raw.shape[0]
    out = fn(raw.reshape(-1, layout.size))
    codes = out[0].reshape(rows, per_row * layout.block)
    packed = codes.view(np.uint8) if layout.signed else pack_codes(codes, layout.bits)
    fields = [f.reshape(rows, -1) for f in out[1:]]
    return [np.ascontiguousarray(packed), *fields]
