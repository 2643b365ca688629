"""Weight constants for one stage graph, in the precision the export asked for.

`fp32` and `fp16` are plain constants (fp16 decompressed to f32 in the graph, the pattern
OpenVINO's plugins run natively); `int8`/`int4` are built as fp32 here and compressed by NNCF
afterwards; `gguf` keeps a GGUF file's own weights: block-quantized types as their codes and
scales bit for bit with the decompression subgraph the plugin fuses (export/decompress.py),
F16/BF16 as 16-bit constants, F32 as f32. What each matrix was kept as is counted in `kept`
(the manifest records it), so nothing is widened without a trace.

With `block_ops` (every export but a static one and `--reblock`), a matmul's and the embedding's
block-quantized weights are the file's very bytes, one u8 constant that shardline's own ops
read (kernels/ops.py): where the kernels do not run (`exact`, another device, a machine without
them), the stage's loader replaces each op by the form above (stage/block_ops.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.errors import ShardlineError
from shardline.export.reblock import fits, reblock, reblocked_constant
from shardline.kernels.ops import block_gather
from shardline.model.decompress import experts_constant, group_constant, half_constant, shared_constant
from shardline.model.quant import Blocks, GroupQuant, HalfFloat, Stored, interleave, stack, stack_blocks
from shardline.model.source import ModelSource

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Linear:
    """The weights of one or more matmuls that share their input, stacked by rows (q, k and v;
    gate and up): one matmul computes them all, and the result splits into `rows`. Fewer,
    larger matmuls: each compiled node has a fixed cost per call, which these small ones feel
    (BENCHMARKS.md, issue 12: +13% decode tok/s with int8 weights)."""

    matrix: ov.Output  # f32-valued [rows, cols]; with `kind`, the file's blocks u8 [rows, row bytes]
    rows: tuple[int, ...]
    kind: str | None = None  # a GGUF block type: `matrix` is its blocks, for kernels/ops.block_matmul
    cols: int = 0


class Weights:
    """Hands out graph constants by Hugging Face tensor name, creating each at most once."""

    def __init__(self, source: ModelSource, precision: str, reblock: int | None = None,
                 block_ops: bool = False) -> None:
        """`reblock`: under gguf, matmul weights re-quantized into groups of that size
        (export/reblock.py: an opt-in that changes them); None keeps the file's blocks.
        `block_ops`: under gguf (and no reblock), block types as the file's bytes for the ops."""
        if precision not in PRECISIONS:
            raise ShardlineError(f"unknown weight precision {precision!r}; choose from {', '.join(PRECISIONS)}")
        if precision == "gguf" and source.format != "gguf":
            raise ShardlineError("--weights gguf needs a GGUF model")
        self.source = source
        self.precision = precision
        self.reblock = reblock
        self.block_ops = block_ops and precision == "gguf" and not reblock
        self._blocks: dict[str, Blocks | None] = {}
        self._block_constants: dict[str, ov.Output] = {}
        self.kept: Counter[str] = Counter()  # stored type -> matrices (under gguf)
        self.kept_bytes: Counter[str] = Counter()
        self._made: dict[str, ov.Output] = {}
        self._stacked: dict[str, Linear | None] = {}
        # The arrays the stored weights' constants are made over (no copy): they must outlive
        # the graph until it is saved or compiled, so the Weights object is kept with it.
        self.keep: list[np.ndarray] = []

    def vector(self, name: str) -> ov.Output:
        """Norm weights and biases: always f32 (tiny, and precision-critical)."""
        if name not in self._made:
            self._made[name] = ops.constant(np.asarray(self.source.tensor(name), dtype=np.float32), name=name).output(0)
        return self._made[name]

    def matrix(self, name: str) -> ov.Output:
        """A 2-D [rows, cols] f32-valued weight (Hugging Face layout), in the export's precision."""
        if name not in self._made:
            self._made[name] = self._matrix(name, gather=False)
        return self._made[name]

    def embedding(self, name: str) -> ov.Output:
        """The token embedding, for a Gather (and the tied head's matmul, which shares it)."""
        if name not in self._made:
            self._made[name] = self._matrix(name, gather=True)
        return self._made[name]

    def experts(self, name: str, experts: int) -> ov.Output:
        """A mixture's stacked expert matrices [experts, rows, cols]: under gguf the file's blocks
        kept (export/decompress.py experts_constant; F16/BF16 as 16-bit), else in the precision."""
        if name not in self._made:
            stored = self.source.stored(name) if self.precision == "gguf" else None
            if isinstance(stored, GroupQuant):
                self._count(stored.kind, stored.nbytes, 1)
                self._made[name] = experts_constant(stored, experts, name, self.keep)
            elif isinstance(stored, HalfFloat):
                self._count(stored.kind, stored.nbytes, 1)
                self._made[name] = half_constant(stored, name, self.keep)
            else:
                w = np.asarray(self.source.tensor(name), dtype=np.float32)
                self._count("F32", w.nbytes, 1)
                self._made[name] = self._constant(w, name)
        return self._made[name]

    def experts_interleaved(self, gate: str, up: str, experts: int) -> ov.Output:
        """Two stacked expert matrices as one [experts, 2 * rows, cols], their rows alternated
        (gate row i at 2i, up row i at 2i + 1): the fused gate-up weight the plugin's gpt-oss
        pattern runs as one GatherMatmul. Under gguf the file's blocks are kept where both share
        a layout; else both are widened to f32."""
        key = f"{gate}|{up}"
        if key not in self._made:
            a, b = (self.source.stored(n) if self.precision == "gguf" else None for n in (gate, up))
            joined = interleave(a, b) if isinstance(a, GroupQuant) and isinstance(b, GroupQuant) else None
            if joined is not None:
                self._count(joined.kind, joined.nbytes, 2)
                self._made[key] = experts_constant(joined, experts, key, self.keep)
            else:
                g, u = (np.asarray(self.source.tensor(n), dtype=np.float32) for n in (gate, up))
                w = np.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1], g.shape[2])
                self._count("F32", w.nbytes, 2)
                self._made[key] = self._constant(w, key)
        return self._made[key]

    def gather(self, name: str, ids: ov.Output) -> ov.Output:
        """Rows `ids` of the token embedding, f32 (under block ops from the very blocks a tied head
        reads)."""
        b = self._file_blocks(name)
        if b is not None:
            return block_gather(self._block_constant(name, b), ids, b.kind, b.cols, name + ".gather")
        return ops.gather(self.embedding(name), ids, ops.constant(np.array([0], dtype=np.int64))).output(0)

    def one(self, name: str) -> Linear:
        """One matmul's weight: the very constant matrix() gives (a tied embedding is stored once)."""
        b = self._file_blocks(name)
        if b is not None:
            return Linear(self._block_constant(name, b), (b.rows,), b.kind, b.cols)
        matrix = self.matrix(name)
        return Linear(matrix, (matrix.get_partial_shape()[0].get_length(),))

    def stacked(self, names: tuple[str, ...]) -> Linear | None:
        """The weights `names` stacked by rows for one matmul, made once; None when they cannot
        share one (stored in different types or layouts: apply them one by one)."""
        key = "|".join(names)
        if key not in self._stacked:
            self._stacked[key] = self._stack(names, key)
        return self._stacked[key]

    def _stack(self, names: tuple[str, ...], key: str) -> Linear | None:
        blocks = [self._file_blocks(n) for n in names]
        if any(b is not None for b in blocks):
            whole = stack_blocks([b for b in blocks if b is not None]) if all(blocks) else None
            if whole is None:  # types or widths differ: one matmul each
                return None
            self._blocks[key] = whole
            return Linear(self._block_constant(key, whole, count=len(names)),
                          tuple(b.rows for b in blocks if b is not None), whole.kind, whole.cols)
        if self.precision == "gguf":
            stored = [self.source.stored(n) for n in names]
            if any(s is not None for s in stored):
                joined = _join(stored)
                if joined is None:
                    return None
                rows = tuple(s.rows if isinstance(s, GroupQuant) else s.bits.shape[0] for s in stored if s is not None)
                return Linear(self._stored_constant(joined, key, gather=False, count=len(names)), rows)
        parts = [np.asarray(self.source.tensor(n), dtype=np.float32) for n in names]
        self._count("F32", sum(p.nbytes for p in parts), len(parts))
        return Linear(self._constant(np.concatenate(parts), key), tuple(w.shape[0] for w in parts))

    def _matrix(self, name: str, gather: bool) -> ov.Output:
        if self.precision == "gguf":
            stored = self.source.stored(name)
            if stored is not None:
                return self._stored_constant(stored, name, gather, count=1)
        w = np.asarray(self.source.tensor(name), dtype=np.float32)  # no copy if f32
        self._count("F32", w.nbytes, 1)
        return self._constant(w, name)

    def _stored_constant(self, s: Stored, name: str, gather: bool, count: int) -> ov.Output:
        if self.reblock and isinstance(s, GroupQuant) and not gather and fits(s, self.reblock):
            r = reblock(s, self.reblock)
            self._count(r.kind, r.nbytes, count)
            return reblocked_constant(r, name, self.keep)
        self._count(s.kind, s.nbytes, count)
        if isinstance(s, HalfFloat):
            return half_constant(s, name, self.keep)
        return group_constant(s, name, self.keep, gather=gather)

    def _file_blocks(self, name: str) -> Blocks | None:
        """The file's blocks of a 2-D block-quantized matrix, under block ops (else None)."""
        if not self.block_ops:
            return None
        if name not in self._blocks:
            self._blocks[name] = self.source.blocks(name)
        return self._blocks[name]

    def _block_constant(self, name: str, b: Blocks, count: int = 1) -> ov.Output:
        """The blocks as one u8 constant, made once (a tied head and the gather share it)."""
        if name not in self._block_constants:
            self._count(b.kind, b.data.nbytes, count)
            c = shared_constant(b.data, list(b.data.shape), ov.Type.u8, self.keep, name + ".blocks")
            self._block_constants[name] = c.output(0)
        return self._block_constants[name]

    def _count(self, kind: str, nbytes: int, n: int) -> None:
        if self.precision == "gguf":
            self.kept[kind] += n
            self.kept_bytes[kind] += nbytes

    def _constant(self, w: np.ndarray, name: str) -> ov.Output:
        if self.precision == "fp16":
            return ops.convert(ops.constant(w.astype(np.float16), name=name), ov.Type.f32).output(0)
        return ops.constant(w, name=name).output(0)


def _join(stored: list[Stored | None]) -> Stored | None:
    """Stored matrices as one (rows after rows), if they share a type and layout."""
    if any(s is None for s in stored):
        return None
    if all(isinstance(s, GroupQuant) for s in stored):
        return stack([s for s in stored if isinstance(s, GroupQuant)])
    halves = [s for s in stored if isinstance(s, HalfFloat)]
    if len(halves) == len(stored) and len({h.kind for h in halves}) == 1:
        return HalfFloat(halves[0].kind, np.concatenate([h.bits for h in halves]))
    return None
