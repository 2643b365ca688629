"""A matrix quantized in groups along its input dimension, kept as the file stores it.

    w[r, g*G + i] = S[r, g] * (code[r, g, i] - zero) + sign * M[r, g]
    S = super_scale[r, g // sub] * group_scale[r, g]          (super_scale absent: 1)
    M = super_min[r, g // sub] * group_min[r, g]              (absent: 0)

This one form holds every GGUF block type shardline keeps: the legacy types (Q4_0 ... Q8_0:
one f16 scale, maybe an f16 min, per group of 32) and the K-quants (an f16 scale and min per
super-block of 256, 4- to 8-bit sub-block scales and mins per group of 16 or 32). Nothing is
multiplied out: the factors are the file's own numbers, so a shard is about the file's size,
and the product is taken in the graph (export/weights.py), which the plugin folds at load.

Codes are stored packed for their OpenVINO type, lowest bits first: u2 (4 per byte), u4 (2 per
byte), u8, or i8 for signed codes. Types with 3-, 5- or 6-bit codes widen them to the next
type the CPU plugin runs in its compressed matmuls (u4, u8): it has no u3/u5/u6 kernels and
would otherwise expand the weights to f32 at load (measured, BENCHMARKS.md issue 21).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CODE_TYPES = {2: "u2", 4: "u4", 8: "u8"}


@dataclass(frozen=True)
class GroupQuant:
    kind: str  # the file's type name (GGML: "Q4_K", ...)
    packed: np.ndarray  # uint8 (rows, groups * group * bits / 8): the codes, packed
    rows: int
    groups: int
    group: int  # values per group (G)
    bits: int  # 2, 4 or 8
    signed: bool  # codes are int8 (Q8_0)
    zero: int  # a code subtracted in every group (Q4_0: 8, Q5_0: 16, Q3_K: 4, Q6_K: 32), or 0
    group_scale: np.ndarray  # (rows, groups): f16, or small integers (K-quants' sub-block scales)
    super_scale: np.ndarray | None = None  # (rows, groups // sub) f16
    group_min: np.ndarray | None = None  # (rows, groups): f16 (Q4_1, Q5_1) or small integers
    super_min: np.ndarray | None = None  # (rows, groups // sub) f16
    min_sign: int = 1  # +1: the legacy types add their min; -1: K-quants subtract theirs

    @property
    def cols(self) -> int:
        return self.groups * self.group

    @property
    def sub(self) -> int:
        """Groups per super-block (1 when there is no super-block scale)."""
        return 1 if self.super_scale is None else self.groups // self.super_scale.shape[1]

    @property
    def code_type(self) -> str:
        return "i8" if self.signed else CODE_TYPES[self.bits]

    @property
    def nbytes(self) -> int:
        arrays = (self.packed, self.group_scale, self.super_scale, self.group_min, self.super_min)
        return sum(a.nbytes for a in arrays if a is not None)

    def codes(self) -> np.ndarray:
        """The codes unpacked, (rows, groups, group): int16, so signed and unsigned alike."""
        codes = unpack_codes(self.packed, self.bits, self.signed).astype(np.int16)
        return codes.reshape(self.rows, self.groups, self.group)

    def scale(self) -> np.ndarray:
        """S as f32 (rows, groups): exact, since no product has more than 24 significant bits."""
        return _product(self.super_scale, self.group_scale, self.sub)

    def offset(self) -> np.ndarray | None:
        """sign * M as f32 (rows, groups), or None."""
        if self.group_min is None:
            return None
        return np.float32(self.min_sign) * _product(self.super_min, self.group_min, self.sub)

    def dequantize(self) -> np.ndarray:
        """f32 (rows, cols), in the operation order of llama.cpp's and gguf-py's dequantization
        (so bit for bit the same values)."""
        w = self.scale()[..., None] * (self.codes() - self.zero).astype(np.float32)
        offset = self.offset()
        if offset is not None:
            w = w + offset[..., None]
        return w.reshape(self.rows, self.cols)


def stack(parts: list[GroupQuant]) -> GroupQuant | None:
    """Several matrices as one, rows after rows; None when their layouts differ."""
    first = parts[0]
    if len(parts) == 1:
        return first
    layout = (first.kind, first.groups, first.group, first.sub)
    if any((p.kind, p.groups, p.group, p.sub) != layout for p in parts):
        return None

    def cat(name: str) -> np.ndarray | None:
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return GroupQuant(
        kind=first.kind, packed=np.concatenate([p.packed for p in parts]), rows=sum(p.rows for p in parts),
        groups=first.groups, group=first.group, bits=first.bits, signed=first.signed, zero=first.zero,
        group_scale=np.concatenate([p.group_scale for p in parts]), super_scale=cat("super_scale"),
        group_min=cat("group_min"), super_min=cat("super_min"), min_sign=first.min_sign,
    )


def interleave(a: GroupQuant, b: GroupQuant) -> GroupQuant | None:
    """Two matrices' rows alternated (a's row i, then b's row i), if they share a layout: a
    mixture's gate and up experts as the one [experts, 2 * rows, cols] the plugin's gpt-oss
    pattern takes. None when their types or layouts differ."""
    layout = (a.kind, a.rows, a.groups, a.group, a.sub)
    if (b.kind, b.rows, b.groups, b.group, b.sub) != layout:
        return None

    def alternate(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        if x is None or y is None:
            return None
        return np.stack([x, y], axis=1).reshape(2 * x.shape[0], *x.shape[1:])

    return GroupQuant(
        kind=a.kind, packed=np.stack([a.packed, b.packed], axis=1).reshape(2 * a.rows, -1), rows=2 * a.rows,
        groups=a.groups, group=a.group, bits=a.bits, signed=a.signed, zero=a.zero,
        group_scale=np.stack([a.group_scale, b.group_scale], axis=1).reshape(2 * a.rows, -1),
        super_scale=alternate(a.super_scale, b.super_scale), group_min=alternate(a.group_min, b.group_min),
        super_min=alternate(a.super_min, b.super_min), min_sign=a.min_sign,
    )


def _product(coarse: np.ndarray | None, fine: np.ndarray, sub: int) -> np.ndarray:
    f = fine.astype(np.float32)
    if coarse is None:
        return f
    return np.repeat(coarse.astype(np.float32), sub, axis=1) * f


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (..., n) in 0..2^bits-1 -> uint8 (..., n * bits / 8), lowest bits first (OpenVINO's
    u2/u4 layout); 8-bit codes are returned as they are (as uint8 bytes)."""
    if bits == 8:
        return codes.astype(np.uint8) if codes.dtype != np.int8 else codes.view(np.uint8)
    per = 8 // bits
    c = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0].copy()
    for i in range(1, per):
        out |= c[..., i] << np.uint8(bits * i)
    return out


def unpack_codes(packed: np.ndarray, bits: int, signed: bool = False) -> np.ndarray:
    """uint8 (..., n) packed -> the codes, uint8 (int8 when signed), lowest bits first."""
    if bits == 8:
        return packed.view(np.int8 if signed else np.uint8)
    per, mask = 8 // bits, np.uint8((1 << bits) - 1)
    parts = [(packed >> np.uint8(bits * i)) & mask for i in range(per)]
    return np.stack(parts, axis=-1).reshape(*packed.shape[:-1], -1)


def repack_codes(packed: np.ndarray, bits: int, to_bits: int, rows_at_a_time: int = 1024) -> np.ndarray:
    """Codes packed at `bits` -> packed at `to_bits` (wider), rows at a time (bounded memory)."""
    out = np.empty((packed.shape[0], packed.shape[1] * to_bits // bits), dtype=np.uint8)
    for r in range(0, packed.shape[0], rows_at_a_time):
        out[r:r + rows_at_a_time] = pack_codes(unpack_codes(packed[r:r + rows_at_a_time], bits), to_bits)
    return out


@dataclass(frozen=True)
class HalfFloat:
    """A 16-bit float matrix kept as it is: F16, or BF16 (numpy has no bfloat16: its bits)."""

    kind: str  # "F16" | "BF16"
    bits: np.ndarray  # uint16 (rows, cols)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def dequantize(self) -> np.ndarray:
        if self.kind == "F16":
            return self.bits.view(np.float16).astype(np.float32)
        return (self.bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Blocks:
    """A block-quantized matrix exactly as the file stores it: `data` uint8 [rows, row bytes], each
    row cols / block values in the type's blocks (what shardline's kernels read, kernels/)."""

    kind: str
    data: np.ndarray
    cols: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


def stack_blocks(parts: list[Blocks]) -> Blocks | None:
    """Matrices of one type and width as one, rows after rows (None if they differ)."""
    if len({(b.kind, b.cols) for b in parts}) != 1:
        return None
    return Blocks(parts[0].kind, np.concatenate([b.data for b in parts]), parts[0].cols)


Stored = GroupQuant | HalfFloat
"""A matrix as a source stores it, when that is not plain f32."""
