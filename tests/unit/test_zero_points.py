"""`--precision fast` rewrites GGUF matmuls with fractional zero points (stage/zero_points.py):
x @ (s*q).T plus the group sums of x times the mins, instead of z. The rewritten graph computes
the same function (f32, no dynamic quantization) and rewrites nothing else; `rounded` rounds z
to a whole code of the codes' own type."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import pytest

from shardline.model.decompress import group_constant
from shardline.model.gguf_blocks import unpack
from shardline.model.quant import GroupQuant
from shardline.stage.zero_points import round_zero_points, split_zero_points
from tests.ggufs import raw_blocks

ROWS, COLS = 12, 256
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def _quant(kind: str, seed: str = "a") -> GroupQuant:
    return unpack(kind, raw_blocks(kind, ROWS, COLS, kind + seed), "w")


KEEP: list[np.ndarray] = []  # the arrays the tests' constants are made over, for the session


def _model(kind: str) -> ov.Model:
    """Two matmuls sharing their input x [B, T, COLS], as a stage's q and k would."""
    x = ops.parameter(ov.PartialShape([-1, -1, COLS]), ov.Type.f32, name="x")
    a = ops.matmul(x, group_constant(_quant(kind), "a", KEEP), False, True)
    b = ops.matmul(x, group_constant(_quant(kind, "b"), "b", KEEP), False, True)
    return ov.Model([ops.result(a), ops.result(b)], [x], "two")


def _run(model: ov.Model, x: np.ndarray) -> list[np.ndarray]:
    compiled = ov.Core().compile_model(model, "CPU", EXACT)
    out = compiled(x)
    return [out[o] for o in compiled.outputs]


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"])
def test_fractional_zero_points_are_rewritten_and_compute_the_same(kind: str) -> None:
    x = np.random.default_rng(2).standard_normal((2, 3, COLS)).astype(np.float32)
    before = _run(_model(kind), x)
    model = _model(kind)
    assert split_zero_points(model) == 2
    types = [n.get_type_name() for n in model.get_ordered_ops()]
    on_codes = [n for n in model.get_ordered_ops() if n.get_type_name() == "Subtract"
                and n.input_value(0).get_node().get_type_name() == "Convert"]
    assert on_codes == []  # no zero point left on the codes
    assert types.count("ReduceSum") == 1  # x's group sums, made once
    after = _run(model, x)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after[0], x @ _quant(kind).dequantize().T, rtol=1e-4, atol=1e-4)  # the file's own


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q3_K", "Q6_K"])
def test_integer_or_no_zero_points_are_left_alone(kind: str) -> None:
    model = _model(kind)
    before = [n.get_type_name() for n in model.get_ordered_ops()]
    assert split_zero_points(model) == 0
    assert [n.get_type_name() for n in model.get_ordered_ops()] == before


@pytest.mark.parametrize("kind,code", [("Q4_1", ov.Type.u4), ("Q4_K", ov.Type.u4), ("Q5_K", ov.Type.u8)])
def test_rounded_zero_points_are_whole_codes_and_nothing_else_changes(kind: str, code: ov.Type) -> None:
    """`--precision rounded`: each group decodes as s * (q - round(z)), with z a constant of the
    codes' own type; the matmuls keep their inputs, and Q4_0 / Q8_0 are left alone."""
    model = _model(kind)
    q = _quant(kind)
    assert round_zero_points(model) == 2
    zero_points = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"
                   and n.get_output_element_type(0) == code and list(n.get_output_partial_shape(0).to_shape())
                   == [ROWS, COLS // q.group, 1]]
    assert len(zero_points) == 2
    x = np.random.default_rng(3).standard_normal((1, 2, COLS)).astype(np.float32)
    scale, offset = q.scale(), q.offset()
    assert offset is not None
    flat = scale == 0  # as the export stores such groups: codes 0, scale |offset| / 8
    scale = np.where(flat, np.where(offset == 0, 1, np.abs(offset) / 8), scale).astype(np.float32)
    z = np.clip(np.round(-offset / scale), 0, 15 if code == ov.Type.u4 else 255)
    codes = np.where(flat[..., None], 0, q.codes()).astype(np.float32)
    w = (scale[..., None] * (codes - z[..., None])).reshape(ROWS, COLS)
    np.testing.assert_allclose(_run(model, x)[0], x @ w.T, rtol=1e-4, atol=1e-4)
    assert not np.allclose(_run(model, x)[0], x @ q.dequantize().T, atol=1e-3)  # other weights
    for other in ("Q4_0", "Q8_0"):
        assert round_zero_points(_model(other)) == 0
