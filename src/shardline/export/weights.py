"""Weight constants for one stage graph, in the precision the export asked for.

`fp32` and `fp16` are plain constants (fp16 decompressed to f32 in the graph, the pattern
OpenVINO's plugins run natively); `int8`/`int4` are built as fp32 here and compressed by NNCF
afterwards; `gguf` keeps a GGUF file's own quantized blocks (codes and scales bit for bit) as
u4/u8/i8 constants followed by the decompression subgraph OpenVINO fuses into its
compressed matmul kernels.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.errors import ShardlineError
from shardline.model.source import ModelSource, QuantBlocks

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")


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

    def vector(self, name: str) -> ov.Output:
        """Norm weights and biases: always f32 (tiny, and precision-critical)."""
        if name not in self._made:
            self._made[name] = ops.constant(self.source.tensor(name).astype(np.float32), name=name).output(0)
        return self._made[name]

    def matrix(self, name: str) -> ov.Output:
        """A 2-D [rows, cols] f32-valued weight (Hugging Face layout), in the export's precision."""
        if name not in self._made:
            self._made[name] = self._matrix(name)
        return self._made[name]

    def _matrix(self, name: str) -> ov.Output:
        if self.precision == "gguf":
            blocks = self.source.blocks(name)
            if blocks is not None:
                return gguf_constant(blocks, name)
        w = self.source.tensor(name).astype(np.float32)
        if self.precision == "fp16":
            c = ops.constant(w.astype(np.float16), name=name)
            return ops.convert(c, ov.Type.f32).output(0)
        return ops.constant(w, name=name).output(0)


def gguf_constant(b: QuantBlocks, name: str) -> ov.Output:
    """codes -> f16 -> (- zero point) -> * scale -> [rows, cols] -> f32.

    Q4_0/Q8_0 are symmetric: their zero point is exactly 8 / the codes are signed. Q4_1's
    additive min m becomes the zero point -m/d, stored in f16 (the form the kernels take);
    codes and scales stay bit-exact.
    """
    rows, groups, block = b.q.shape
    if b.kind == "Q8_0":
        codes = ops.constant((b.q.astype(np.int16) - 128).astype(np.int8), name=name + ".codes")
        scale = ops.constant(b.scale.reshape(rows, groups, 1), name=name + ".scale")
        deq = ops.multiply(ops.convert(codes, ov.Type.f16), scale)
    else:
        if b.kind == "Q4_0":
            q, d, z = b.q, b.scale, np.full((1, 1, 1), 8, dtype=np.float32)
        else:
            q, d, z = _q4_1_zero_points(b)
        codes = ops.constant(_u4_tensor(q), name=name + ".codes")
        scale = ops.constant(d.reshape(rows, groups, 1), name=name + ".scale")
        zp = ops.constant(z.astype(np.float16), name=name + ".zp")
        deq = ops.multiply(ops.subtract(ops.convert(codes, ov.Type.f16), zp), scale)
    flat = ops.reshape(deq, ops.constant(np.array([rows, groups * block], dtype=np.int64)), False)
    return ops.convert(flat, ov.Type.f32).output(0)


def _q4_1_zero_points(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w = d*q + m as d*(q - z) with z = -m/d. A block with d == 0 (all values equal m) gets
    codes 0 and d = |m|/8, so z = -m/d = -+8 exactly and the block still decodes to m."""
    d = b.scale.copy()
    q = b.q
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
