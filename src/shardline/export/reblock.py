"""`export --reblock G`: a GGUF's block weights re-quantized into groups of G, the layout the CPU
plugin's int8 kernels stream fastest. A named opt-in: it changes the weights.

The file's own blocks (groups of 32 or 16, each with its own scale and min) are what `--weights
gguf` keeps bit for bit. On a 2-core CPU the plugin's compressed matmul runs them at ~39 G
weights/s with int8 activations (Q4_K, mins apart) against ~64 G/s for u4 codes with an integer
zero point and an f16 scale per group of 128 (BENCHMARKS.md, issue 22): the smaller the group,
the more per-group float work per weight. llama.cpp's repacked kernels reach ~63 G/s on the same
file, so the file's own layout cannot come within 0.9x of it here; re-blocked it can.

Each matrix is dequantized (exactly, as llama.cpp reads it) a few rows at a time, then rounded to
nearest in groups of G with an asymmetric range: w ~ scale * (code - zero), scale an f16 and zero
an integer per group. Codes of <= 4 bits become u4 (16 levels over the group's range); wider ones
(Q5-Q8, Q6_K) become u8, which keeps more than they had. What this costs in quality is measured
in BENCHMARKS.md (bench/quality.py --reblock). Matrices whose input width G does not divide, and
gathers (the token embedding), keep the file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.errors import ShardlineError
from shardline.model.decompress import shared_constant
from shardline.model.quant import GroupQuant, pack_codes

ROWS_AT_A_TIME = 256  # rows dequantized at once: bounded memory (256 x 14336 f32 = 14.7 MB)


@dataclass(frozen=True)
class Reblocked:
    """w[r, g*G + i] = scale[r, g] * (code[r, g, i] - zero[r, g]); codes packed as u4 or u8."""

    kind: str  # the file's type and what it became, e.g. "Q4_K>u4g128"
    packed: np.ndarray  # uint8 (rows, cols * bits / 8)
    zero: np.ndarray  # uint8 (rows, groups): integer zero points
    scale: np.ndarray  # float16 (rows, groups)
    rows: int
    groups: int
    group: int
    bits: int  # 4 or 8

    @property
    def cols(self) -> int:
        return self.groups * self.group

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + (self.zero.nbytes * self.bits // 8)

    def dequantize(self) -> np.ndarray:
        from shardline.model.quant import unpack_codes

        codes = unpack_codes(self.packed, self.bits).reshape(self.rows, self.groups, self.group).astype(np.float32)
        w = self.scale.astype(np.float32)[..., None] * (codes - self.zero.astype(np.float32)[..., None])
        return w.reshape(self.rows, self.cols)


def fits(q: GroupQuant, group: int) -> bool:
    return q.cols % group == 0


def reblock(q: GroupQuant, group: int) -> Reblocked:
    """`q` re-quantized into groups of `group` (which must divide its columns)."""
    if not fits(q, group):
        raise ShardlineError(f"a {q.kind} matrix of {q.cols} columns cannot be re-blocked into groups of {group}")
    bits = 4 if q.bits <= 4 and not q.signed else 8
    groups = q.cols // group
    packed = np.empty((q.rows, q.cols * bits // 8), np.uint8)
    zero = np.empty((q.rows, groups), np.uint8)
    scale = np.empty((q.rows, groups), np.float16)
    for r in range(0, q.rows, ROWS_AT_A_TIME):
        part = _rows(q, r, min(q.rows, r + ROWS_AT_A_TIME))
        c, z, s = _round(part.dequantize().reshape(part.rows, groups, group), bits)
        packed[r:r + part.rows] = pack_codes(c.reshape(part.rows, -1), bits)
        zero[r:r + part.rows], scale[r:r + part.rows] = z, s
    return Reblocked(f"{q.kind}>u{bits}g{group}", packed, zero, scale, q.rows, groups, group, bits)


def _round(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round to nearest over each group's range, widened to hold 0 (an integer zero point in
    [0, top] can only place 0 inside it): (codes, zero points, f16 scales). The scale is rounded
    up to f16, and the codes made against that rounded scale: then the grid, shifted by the
    rounded zero point, still spans the range, and every value is within half a step."""
    top = (1 << bits) - 1
    lo, hi = np.minimum(w.min(axis=-1), 0), np.maximum(w.max(axis=-1), 0)
    exact = (hi - lo) / np.float32(top)
    scale = exact.astype(np.float16)
    short = scale.astype(np.float32) < exact
    scale[short] = np.nextafter(scale[short], np.float16(np.inf))
    scale[scale == 0] = 1  # a constant group: any scale; its codes all equal its zero point
    s = scale.astype(np.float32)
    zero = np.clip(np.round(-lo / s), 0, top)
    codes = np.clip(np.round(w / s[..., None]) + zero[..., None], 0, top)
    return codes.astype(np.uint8), zero.astype(np.uint8), scale


def _rows(q: GroupQuant, start: int, end: int) -> GroupQuant:
    """Rows [start, end) of `q` (views: nothing copied)."""
    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[start:end]

    return GroupQuant(kind=q.kind, packed=q.packed[start:end], rows=end - start, groups=q.groups, group=q.group,
                      bits=q.bits, signed=q.signed, zero=q.zero, group_scale=q.group_scale[start:end],
                      super_scale=cut(q.super_scale), group_min=cut(q.group_min), super_min=cut(q.super_min),
                      min_sign=q.min_sign)


def reblocked_constant(r: Reblocked, name: str, keep: list[np.ndarray]) -> ov.Output:
    """A re-blocked matrix (export/reblock.py) as Reshape(Multiply(Subtract(Convert(codes),
    Convert(zero)), Convert(scale))): integer zero points of the codes' type and f16 scales, the
    pattern the plugin runs with int8 activations."""
    kind = ov.Type.u4 if r.bits == 4 else ov.Type.u8
    codes = shared_constant(r.packed, [r.rows, r.groups, r.group], kind, keep, name + ".codes")
    zero_bits = r.bits if r.zero.size % 2 == 0 else 8  # u4 packs pairs
    zero = shared_constant(pack_codes(r.zero.reshape(-1), zero_bits), [r.rows, r.groups, 1],
                   kind if zero_bits == r.bits else ov.Type.u8, keep, name + ".zp")
    scale = shared_constant(r.scale, [r.rows, r.groups, 1], ov.Type.f16, keep, name + ".scale")
    x = ops.subtract(ops.convert(codes, ov.Type.f32), ops.convert(zero, ov.Type.f32))
    deq = ops.multiply(x, ops.convert(scale, ov.Type.f32))
    return ops.reshape(deq, _i64(r.rows, r.cols), False).output(0)


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))
