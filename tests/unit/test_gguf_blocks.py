"""GGUF block decompression graphs decode to the file's values (synthetic blocks, no model)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import pytest

from shardline.export.weights import gguf_constant
from shardline.model.source import QuantBlocks


def _evaluate(b: QuantBlocks) -> np.ndarray:
    """Run the decompression subgraph as it is exported (f32 inference, as in exact mode)."""
    model = ov.Model([ops.result(gguf_constant(b, "w"))], [])
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({})[0]


def _blocks(kind: str, rng: np.random.Generator) -> QuantBlocks:
    rows, groups = 4, 3
    d = rng.uniform(0.001, 0.05, size=(rows, groups)).astype(np.float16)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, size=(rows, groups, 32)).astype(np.int8)
        return QuantBlocks(kind, q, d, np.zeros_like(d), 8)
    q = rng.integers(0, 16, size=(rows, groups, 32)).astype(np.uint8)
    m = (-8 * d.astype(np.float32)) if kind == "Q4_0" else rng.uniform(-0.3, 0.0, (rows, groups))
    return QuantBlocks(kind, q, d, m.astype(np.float16), 4)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_symmetric_blocks_decode_exactly(kind: str) -> None:
    b = _blocks(kind, np.random.default_rng(0))
    np.testing.assert_array_equal(_evaluate(b), b.dequantize())


def test_q4_1_decodes_to_f32_rounding() -> None:
    b = _blocks("Q4_1", np.random.default_rng(1))
    np.testing.assert_allclose(_evaluate(b), b.dequantize(), rtol=0, atol=1e-6)


def test_q4_1_block_with_zero_scale_decodes_to_its_min() -> None:
    b = _blocks("Q4_1", np.random.default_rng(2))
    b.scale[1, 2] = 0
    b.offset[1, 2] = np.float16(-0.125)
    b.scale[2, 0] = 0
    b.offset[2, 0] = 0
    out = _evaluate(b).reshape(b.q.shape)
    assert (out[1, 2] == np.float32(-0.125)).all()
    assert (out[2, 0] == 0).all()
