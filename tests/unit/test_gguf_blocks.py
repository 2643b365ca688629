"""Every GGUF block type kept as its own codes and scales (model/gguf_blocks.py) decodes, bit for
bit, to gguf-py's dequantization; the decompression subgraph the export writes for it
(export/decompress.py) gives those values to f32 rounding, in a matmul and in a gather; and the
CPU plugin keeps it compressed (no f32 copy of the matrix in the compiled model)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from shardline.errors import ShardlineError
from shardline.model.decompress import group_constant
from shardline.model.gguf_blocks import BLOCK_TYPES, block_bytes, unpack
from tests.ggufs import raw_blocks

ROWS, COLS = 48, 512
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# What the CPU plugin runs each type's codes as: 3-, 5- and 6-bit codes widen to u4 / u8.
CODE_TYPES = {"Q4_0": "u4", "Q4_1": "u4", "Q5_0": "u8", "Q5_1": "u8", "Q8_0": "i8", "Q2_K": "u2", "Q3_K": "u4",
              "Q4_K": "u4", "Q5_K": "u8", "Q6_K": "u8", "MXFP4": "i8"}


def _reference(kind: str, raw: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(ROWS, COLS)


def _with_flat_groups(kind: str, raw: np.ndarray) -> np.ndarray:
    """Zero the first scale field of some blocks (a sub-block, or a block, that decodes to its
    min alone): rare in real files, and where a naive zero point divides by zero."""
    raw = raw.copy()
    per_row = raw.shape[1] // block_bytes(kind)[1]
    blocks = raw.reshape(ROWS * per_row, -1)
    if kind == "Q2_K":
        blocks[::5, 0] &= 0xF0  # sub-block 0's scale (its min stays)
    elif kind in ("Q4_K", "Q5_K"):
        blocks[::5, 4] &= 0xC0  # sub-block 0's six scale bits (its min stays)
    else:  # the block's f16 scale d itself
        at = {"Q3_K": 108, "Q6_K": 208}.get(kind, 0)
        blocks[::5, at:at + 2] = 0
    return raw


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_unpacked_blocks_decode_bit_for_bit_like_gguf(kind: str) -> None:
    plain = raw_blocks(kind, ROWS, COLS, "bits" + kind)
    for raw in (plain, _with_flat_groups(kind, plain)):
        q = unpack(kind, raw, "w")
        assert (q.rows, q.cols, q.code_type) == (ROWS, COLS, CODE_TYPES[kind])
        np.testing.assert_array_equal(q.dequantize().view(np.uint32), _reference(kind, raw).view(np.uint32))


def _compiled(q_out: ov.Output, gather: bool) -> ov.CompiledModel:
    if gather:
        ids = ops.parameter(ov.PartialShape([1, -1]), ov.Type.i64, name="ids")
        model = ov.Model([ops.result(ops.gather(q_out, ids, np.int64(0)))], [ids])
    else:
        x = ops.parameter(ov.PartialShape([1, -1, COLS]), ov.Type.f32, name="x")
        model = ov.Model([ops.result(ops.matmul(x, q_out, False, True))], [x])
    return ov.Core().compile_model(model, "CPU", EXACT)


@pytest.mark.parametrize("gather", [False, True], ids=["matmul", "gather"])
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_decompression_graph_gives_the_files_values(kind: str, gather: bool) -> None:
    raw = _with_flat_groups(kind, raw_blocks(kind, ROWS, COLS, "graph" + kind))
    q = unpack(kind, raw, "w")
    ref = _reference(kind, raw)
    keep: list[np.ndarray] = []  # the arrays the constants are made over
    compiled = _compiled(group_constant(q, "w", keep, gather=gather), gather)
    if gather:
        got = compiled(np.arange(ROWS, dtype=np.int64)[None])[0][0]
    else:
        got = compiled(np.eye(COLS, dtype=np.float32)[None])[0][0].T  # the identity reads W back
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-7 * float(np.abs(ref).max()))


@pytest.mark.parametrize("gather", [False, True], ids=["matmul", "gather"])
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_the_plugin_keeps_the_weights_compressed(kind: str, gather: bool) -> None:
    """The compiled model holds the codes in their own type, and no f32 (or f16) matrix."""
    q = unpack(kind, raw_blocks(kind, ROWS, COLS, "plugin" + kind), "w")
    keep: list[np.ndarray] = []
    runtime = _compiled(group_constant(q, "w", keep, gather=gather), gather).get_runtime_model()
    consts = [(str(op.get_rt_info()["outputPrecisions"].astype(str)), list(op.get_output_partial_shape(0).to_shape()))
              for op in runtime.get_ordered_ops() if op.get_rt_info()["layerType"].astype(str) == "Const"]
    matrices = [t for t, shape in consts if shape == [ROWS, COLS]]
    expected = "u4" if gather and kind == "Q2_K" else CODE_TYPES[kind]  # no u2 gather: widened at export
    assert matrices == [expected], consts


def test_a_type_that_cannot_be_kept_or_a_torn_row_is_refused() -> None:
    with pytest.raises(ShardlineError, match="tensor w: type IQ2_XXS cannot be kept as blocks"):
        unpack("IQ2_XXS", np.zeros((2, 66), np.uint8), "w")
    with pytest.raises(ShardlineError, match="not a whole number of Q4_K blocks"):
        unpack("Q4_K", np.zeros((2, 150), np.uint8), "w")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_1", "MXFP4"])
def test_two_matrices_interleaved_decode_to_their_rows_alternated(kind: str) -> None:
    """gpt-oss's gate and up experts as one fused weight (model/quant.py interleave)."""
    from shardline.model.quant import interleave

    a, b = (unpack(kind, raw_blocks(kind, ROWS, COLS, seed + kind), "w") for seed in ("gate", "up"))
    joined = interleave(a, b)
    assert joined is not None and joined.rows == 2 * ROWS
    want = np.stack([a.dequantize(), b.dequantize()], axis=1).reshape(2 * ROWS, COLS)
    np.testing.assert_array_equal(joined.dequantize().view(np.uint32), want.view(np.uint32))
    other = unpack("Q8_0", raw_blocks("Q8_0", ROWS, COLS, "other"), "w")
    assert interleave(a, other) is None  # types differ: no one layout
