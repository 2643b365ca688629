"""Weight constants for one stage graph, in the precision the export asked for.

`fp32` and `fp16` are plain constants (fp16 decompressed to f32 in the graph, the pattern
OpenVINO's plugins run natively); `int8`/`int4` are built as fp32 here and compressed by NNCF
afterwards; `gguf` keeps a GGUF file's own quantized blocks (codes and scales bit for bit) as
u4/u8/i8 constants followed by the decompression subgraph OpenVINO fuses into its
compressed matmul kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.errors import ShardlineError
from shardline.model.source import ModelSource, QuantBlocks

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")


@dataclass(frozen=True)
class Linear:
    """The weights of one or more matmuls that share their input, stacked by rows (q, k and v;
    gate and up): one matmul computes them all, and the result splits into `rows`. Fewer,
    larger matmuls: each compiled node has a fixed cost per call, which these small ones feel
    (BENCHMARKS.md, issue 12: +13% decode tok/s with int8 weights)."""

    matrix: ov.Output
    rows: tuple[int, ...]


class Weights:
    """Hands out graph constants by Hugging Face tensor name, creating each at most once."""

    def __init__(self, source: ModelSource, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ShardlineError(f"unknown weight precision {precision!r}; choose from {', '.join(PRECISIONS)}")
        if precision == "gguf" and source.format != "gguf":
            raise ShardlineError("--weights gguf needs a GGUF model")
        self.source = source
        self.precision = precision
        self._made: dict[str, ov.Output] = {}
        self._stacked: dict[str, Linear | None] = {}

    def vector(self, name: str) -> ov.Output:
        """Norm weights and biases: always f32 (tiny, and precision-critical)."""
        if name not in self._made:
            self._made[name] = ops.constant(np.asarray(self.source.tensor(name), dtype=np.float32), name=name).output(0)
        return self._made[name]

    def matrix(self, name: str) -> ov.Output:
        """A 2-D [rows, cols] f32-valued weight (Hugging Face layout), in the export's precision."""
        if name not in self._made:
            self._made[name] = self._matrix(name)
        return self._made[name]

    def one(self, name: str) -> Linear:
        """One matmul's weight: the very constant matrix() gives (a tied embedding is stored once)."""
        matrix = self.matrix(name)
        return Linear(matrix, (matrix.get_partial_shape()[0].get_length(),))

    def stacked(self, names: tuple[str, ...]) -> Linear | None:
        """The weights `names` stacked by rows for one matmul, made once; None when they cannot
        share one (GGUF blocks of different kinds or shapes: apply them one by one)."""
        key = "|".join(names)
        if key not in self._stacked:
            self._stacked[key] = self._stack(names, key)
        return self._stacked[key]

    def _stack(self, names: tuple[str, ...], key: str) -> Linear | None:
        blocks = [self.source.blocks(n) for n in names] if self.precision == "gguf" else []
        if any(b is not None for b in blocks):
            found = [b for b in blocks if b is not None]
            stacked = stack_blocks(found) if len(found) == len(names) else None
            return None if stacked is None else Linear(gguf_constant(stacked, key), tuple(b.q.shape[0] for b in found))
        parts = [np.asarray(self.source.tensor(n), dtype=np.float32) for n in names]
        return Linear(self._constant(np.concatenate(parts), key), tuple(w.shape[0] for w in parts))

    def _matrix(self, name: str) -> ov.Output:
        if self.precision == "gguf":
            blocks = self.source.blocks(name)
            if blocks is not None:
                return gguf_constant(blocks, name)
        return self._constant(np.asarray(self.source.tensor(name), dtype=np.float32), name)  # no copy if f32

    def _constant(self, w: np.ndarray, name: str) -> ov.Output:
        if self.precision == "fp16":
            return ops.convert(ops.constant(w.astype(np.float16), name=name), ov.Type.f32).output(0)
        return ops.constant(w, name=name).output(0)


def gguf_constant(b: QuantBlocks, name: str) -> ov.Output:
    """codes -> f32 -> (- zero point) -> * scale -> [rows, cols].

    Codes (u4 / i8) and scales (f16) are the file's own, bit for bit. Q4_1's additive min m
    becomes the f32 zero point -m/d, so d*(q - z) equals the file's d*q + m to f32 rounding.
    The CPU plugin matches this chain and keeps the weights compressed inside its matmuls.
    """
    rows, groups, block = b.q.shape
    q, d, z = _codes_scales_zero_points(b)
    x = ops.convert(ops.constant(q if b.bits == 8 else _u4_tensor(q), name=name + ".codes"), ov.Type.f32)
    if z is not None:
        x = ops.subtract(x, ops.constant(z, name=name + ".zp"))
    scale = ops.convert(ops.constant(d.reshape(rows, groups, 1), name=name + ".scale"), ov.Type.f32)
    deq = ops.multiply(x, scale)
    return ops.reshape(deq, ops.constant(np.array([rows, groups * block], dtype=np.int64)), False).output(0)


def stack_blocks(blocks: list[QuantBlocks]) -> QuantBlocks | None:
    """Several block-quantized matrices as one, rows after rows (None: kinds or blocks differ)."""
    first = blocks[0]
    if any(b.kind != first.kind or b.q.shape[1:] != first.q.shape[1:] for b in blocks):
        return None
    if len(blocks) == 1:
        return first
    return QuantBlocks(first.kind, np.concatenate([b.q for b in blocks]), np.concatenate([b.scale for b in blocks]),
                       np.concatenate([b.offset for b in blocks]), first.bits)


def _codes_scales_zero_points(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if b.kind == "Q8_0":  # signed codes, no zero point
        return b.q, b.scale, None
    if b.kind == "Q4_0":
        return b.q, b.scale, np.full((1, 1, 1), 8, dtype=np.float32)
    # Q4_1. A block with d == 0 (all values equal m) gets codes 0 and d = |m|/8, so that
    # z = -m/d = -+8 exactly and the block still decodes to m.
    d, q = b.scale.copy(), b.q
    flat = d == 0
    if flat.any():
        q = np.where(flat[..., None], 0, b.q).astype(np.uint8)
        d[flat] = np.where(b.offset[flat] != 0, np.abs(b.offset[flat]) / 8, 1).astype(np.float16)
    return q, d, (-b.offset.astype(np.float32) / d.astype(np.float32))[..., None]


def _u4_tensor(q: np.ndarray) -> ov.Tensor:
    """Pack uint8 codes 0..15 two per byte, low nibble first (OpenVINO's u4 layout)."""
    flat = q.reshape(-1)
    packed = (flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)
    t = ov.Tensor(ov.Type.u4, ov.Shape(list(q.shape)))
    np.copyto(t.data.view(np.uint8).reshape(-1), packed.astype(np.uint8))
    return t
