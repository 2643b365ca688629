"""`--precision fast` on GGUF Q4_1 weights: their additive min applied apart from the codes.

A Q4_1 block decodes as w = d*q + m. The export writes it as d*(q - z) with the f32 zero point
z = -m/d (export/weights.py), which is exact but fractional, and a fractional zero point keeps
OpenVINO's CPU plugin from quantizing activations to int8 inside its compressed matmuls (its
dynamic quantization, which `fast` allows). So, for `fast` only, each such matmul is rewritten
at load time as

    x @ (d*q).T  +  group_sums(x) @ m.T        (group_sums: each block of inputs added up)

The first term has no zero point and takes the fast kernels; the second is a small f32 matmul
([B, T, groups] by [groups, rows]). Measured on the default model (BENCHMARKS.md, issue 12):
decode +7% and TTFT -25% in `fast`, but 15% slower where activations stay f32 (`exact`), which
is why the export keeps the zero-point form and only `fast` rewrites it.

openvino_genai rounds z to an integer code instead, which changes the weights; `--precision
rounded` does the same (`round_zero_points`) for those who want that speed and accept it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset15 as ops


@dataclass(frozen=True)
class _Q4:
    """A decompression chain Reshape(Multiply(Subtract(Convert(codes), z), Convert(d))) feeding a
    MatMul's weights, taken apart."""

    codes: ov.Output  # Convert(codes) -> f32 [rows, groups, block]
    scale: ov.Output  # Convert(d) -> f32 [rows, groups, 1]
    shape: ov.Output  # the Reshape's target [rows, groups * block]
    mins: np.ndarray  # m = -z*d, f32 [rows, groups]
    block: int
    subtract: ov.Node  # Subtract(codes, z)
    zero: np.ndarray  # z, f32 [rows, groups, 1]


def split_zero_points(model: ov.Model) -> int:
    """Rewrite in place every MatMul whose weights decompress with a fractional zero point;
    returns how many were rewritten."""
    sums: dict[tuple[str, int, int], ov.Output] = {}
    done = 0
    for node, q4 in _matmuls(model):
        x = node.input_value(0)
        key = (x.get_node().get_friendly_name(), x.get_index(), q4.block)
        if key not in sums:
            sums[key] = ops.reduce_sum(ops.reshape(x, _i64(0, 0, -1, q4.block), True), _i64(-1), False).output(0)
        weights = ops.reshape(ops.multiply(q4.codes, q4.scale), q4.shape, False)
        mins = ops.convert(ops.constant(q4.mins.astype(np.float16)), ov.Type.f32)  # m was f16 in the file
        y = ops.add(ops.matmul(x, weights, False, True), ops.matmul(sums[key], mins, False, True))
        for target in node.output(0).get_target_inputs():
            target.replace_source_output(y.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def round_zero_points(model: ov.Model) -> int:
    """`--precision rounded`: every fractional zero point becomes the nearest code (0-15), a u4
    constant, as openvino_genai reads Q4_1. The matmuls then take the plugin's fastest kernels
    with no extra node, but each weight moves by up to half a step; returns how many changed."""
    done = 0
    for _, q4 in _matmuls(model):
        codes = np.clip(np.round(q4.zero), 0, 15).astype(np.uint8)
        rounded = ops.convert(ops.constant(codes, dtype=ov.Type.u4), ov.Type.f32)
        q4.subtract.input(1).replace_source_output(rounded.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def _matmuls(model: ov.Model) -> list[tuple[ov.Node, _Q4]]:
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() == "MatMul" and node.get_attributes().get("transpose_b"):
            q4 = _chain(node.input_value(1).get_node())
            if q4 is not None:
                found.append((node, q4))
    return found


def _chain(reshape: ov.Node) -> _Q4 | None:
    if reshape.get_type_name() != "Reshape":
        return None
    mul = reshape.input_value(0).get_node()
    if mul.get_type_name() != "Multiply":
        return None
    sub, scale = mul.input_value(0).get_node(), mul.input_value(1)
    if sub.get_type_name() != "Subtract" or scale.get_node().get_type_name() != "Convert":
        return None
    codes, zp = sub.input_value(0), sub.input_value(1).get_node()
    d = scale.get_node().input_value(0).get_node()
    if (codes.get_node().get_type_name() != "Convert" or zp.get_type_name() != "Constant"
            or d.get_type_name() != "Constant" or zp.get_output_element_type(0) != ov.Type.f32):
        return None
    z, dv = zp.get_data().astype(np.float32), d.get_data().astype(np.float32)
    if z.ndim != 3 or dv.shape != z.shape or np.array_equal(z, np.round(z)):
        return None  # integer zero points (Q4_0's 8) already take the fast kernels
    block = int(codes.get_partial_shape()[2].get_length())
    return _Q4(codes, scale, reshape.input_value(1), (-z * dv)[..., 0], block, sub, z)


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))
