"""`--precision fast` rewrites GGUF Q4_1 matmuls (stage/zero_points.py): x @ (d*q).T plus the
group sums of x times the mins, instead of a fractional zero point. The rewritten graph computes
the same function (f32, no dynamic quantization) and rewrites nothing else."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import pytest

from shardline.export.weights import _codes_scales_zero_points, gguf_constant
from shardline.model.source import QuantBlocks
from shardline.stage.zero_points import round_zero_points, split_zero_points

ROWS, GROUPS, BLOCK = 12, 3, 32
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def _blocks(kind: str, seed: int = 0) -> QuantBlocks:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.01, 0.1, (ROWS, GROUPS)).astype(np.float16)
    if kind == "Q8_0":
        q = rng.integers(-127, 128, (ROWS, GROUPS, BLOCK)).astype(np.int8)
        return QuantBlocks(kind, q, scale, np.zeros((ROWS, GROUPS), np.float16), 8)
    q = rng.integers(0, 16, (ROWS, GROUPS, BLOCK)).astype(np.uint8)
    offset = (-8 * scale.astype(np.float32)).astype(np.float16) if kind == "Q4_0" else \
        rng.uniform(-1.0, 0.2, (ROWS, GROUPS)).astype(np.float16)
    offset[0, 0] = scale[1, 1] = 0  # a flat block (d = 0: every value is m) and a zero min
    return QuantBlocks(kind, q, scale, offset, 4)


def _model(blocks: QuantBlocks) -> ov.Model:
    """Two matmuls sharing their input x [B, T, GROUPS * BLOCK], as a stage's q and k would."""
    x = ops.parameter(ov.PartialShape([-1, -1, GROUPS * BLOCK]), ov.Type.f32, name="x")
    a = ops.matmul(x, gguf_constant(blocks, "a"), False, True)
    b = ops.matmul(x, gguf_constant(_blocks(blocks.kind, seed=1), "b"), False, True)
    return ov.Model([ops.result(a), ops.result(b)], [x], "two")


def _run(model: ov.Model, x: np.ndarray) -> list[np.ndarray]:
    compiled = ov.Core().compile_model(model, "CPU", EXACT)
    out = compiled(x)
    return [out[o] for o in compiled.outputs]


def test_q4_1_is_rewritten_and_computes_the_same() -> None:
    blocks = _blocks("Q4_1")
    x = np.random.default_rng(2).standard_normal((2, 3, GROUPS * BLOCK)).astype(np.float32)
    before = _run(_model(blocks), x)
    model = _model(blocks)
    assert split_zero_points(model) == 2
    types = [n.get_type_name() for n in model.get_ordered_ops()]
    assert "Subtract" not in types and types.count("ReduceSum") == 1  # x's group sums, made once
    after = _run(model, x)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    w = blocks.dequantize()  # and both are the file's own weights
    np.testing.assert_allclose(after[0], x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_integer_or_no_zero_points_are_left_alone(kind: str) -> None:
    model = _model(_blocks(kind))
    before = [n.get_type_name() for n in model.get_ordered_ops()]
    assert split_zero_points(model) == 0
    assert [n.get_type_name() for n in model.get_ordered_ops()] == before


def test_rounded_zero_points_are_whole_codes_and_nothing_else_changes() -> None:
    """`--precision rounded`: each block decodes as d * (q - round(z)), z = -m/d, with u4 zero
    points; the graph keeps its shape (no node added) and Q4_0 / Q8_0 are left alone."""
    blocks = _blocks("Q4_1")
    model = _model(blocks)
    before = [n.get_type_name() for n in model.get_ordered_ops()]
    assert round_zero_points(model) == 2
    assert [n.get_type_name() for n in model.get_ordered_ops() if n.get_type_name() != "Convert"] == \
        [t for t in before if t != "Convert"]
    zero_points = [n for n in model.get_ordered_ops()
                   if n.get_type_name() == "Constant" and n.get_output_element_type(0) == ov.Type.u4
                   and n.get_output_partial_shape(0).to_shape()[-1] == 1]
    assert len(zero_points) == 2
    x = np.random.default_rng(3).standard_normal((1, 2, GROUPS * BLOCK)).astype(np.float32)
    q, d, z = _codes_scales_zero_points(blocks)  # as the export wrote them (a flat block's too)
    assert z is not None
    w = (d.astype(np.float32)[..., None] * (q.astype(np.float32) - np.clip(np.round(z), 0, 15)))
    w = w.reshape(ROWS, GROUPS * BLOCK)
    np.testing.assert_allclose(_run(model, x)[0], x @ w.T, rtol=1e-4, atol=1e-4)
    assert not np.allclose(_run(model, x)[0], x @ blocks.dequantize().T, atol=1e-3)  # other weights
    for kind in ("Q4_0", "Q8_0"):
        assert round_zero_points(_model(_blocks(kind))) == 0
