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

from shardline.model.quant import unpack_codes


@dataclass(frozen=True)
class _Q4:
    """A decompression chain Reshape(Multiply(Subtract(Convert(codes), z), s)) feeding a
    MatMul's weights, taken apart (s and z: constants, or subgraphs of constants, as the export
    writes them for K-quants)."""

    codes: ov.Output  # Convert(codes) -> f32 [rows, groups, block]
    scale: ov.Output  # s -> f32 [rows, groups, 1]
    shape: ov.Output  # the Reshape's target [rows, groups * block]
    mins: np.ndarray  # m = -z*s, f32 [rows, groups]
    block: int
    subtract: ov.Node  # Subtract(codes, z)
    zero: np.ndarray  # z, f32 [rows, groups, 1]
    code_type: ov.Type  # u2 / u4 / u8


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
        mins = ops.constant(q4.mins.astype(np.float32))
        y = ops.add(ops.matmul(x, weights, False, True), ops.matmul(sums[key], mins, False, True))
        for target in node.output(0).get_target_inputs():
            target.replace_source_output(y.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def round_zero_points(model: ov.Model) -> int:
    """`--precision rounded`: every fractional zero point becomes the nearest code, a constant of
    the codes' own type, as openvino_genai reads Q4_1. The matmuls then take the plugin's fastest
    kernels with no extra node, but each weight moves by up to half a step; returns how many
    changed."""
    done = 0
    for _, q4 in _matmuls(model):
        top = {ov.Type.u2: 3, ov.Type.u4: 15}.get(q4.code_type, 255)
        codes = np.clip(np.round(q4.zero), 0, top).astype(np.uint8)
        rounded = ops.convert(ops.constant(codes, dtype=q4.code_type), ov.Type.f32)
        q4.subtract.input(1).replace_source_output(rounded.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def uniform_group(model: ov.Model) -> int | None:
    """The group size every compressed matmul's weights share (their codes [rows, groups, G]),
    or None when they differ or there are none. The plugin's int8 quantization of activations
    runs best in groups of the weights' own (`fast`: BENCHMARKS.md, issue 22; a re-blocked export
    in groups of 128 took 196 ms a token with the plugin's default of 32, 138 ms with 128)."""
    sizes = set()
    for node in model.get_ordered_ops():
        if node.get_type_name() == "MatMul" and node.get_attributes().get("transpose_b"):
            codes = _codes_of(node.input_value(1).get_node())
            if codes is not None:
                sizes.add(int(codes.get_partial_shape()[2].get_length()))
    return sizes.pop() if len(sizes) == 1 else None


def _codes_of(reshape: ov.Node) -> ov.Output | None:
    """The codes constant under Reshape(Multiply(Subtract?(Convert(codes), z), s)), if 3-D."""
    if reshape.get_type_name() != "Reshape":
        return None
    node = reshape.input_value(0).get_node()
    for kind in ("Multiply", "Subtract"):
        if node.get_type_name() == kind:
            node = node.input_value(0).get_node()
    if node.get_type_name() != "Convert" or node.input_value(0).get_node().get_type_name() != "Constant":
        return None
    codes = node.input_value(0)
    return codes if codes.get_partial_shape().rank.get_length() == 3 else None


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
    if sub.get_type_name() != "Subtract":
        return None
    codes = sub.input_value(0)
    if codes.get_node().get_type_name() != "Convert":
        return None
    code_type = codes.get_node().input_value(0).get_element_type()
    z, s = constant_value(sub.input_value(1)), constant_value(scale)
    if z is None or s is None or s.ndim != 3 or code_type not in (ov.Type.u2, ov.Type.u4, ov.Type.u8):
        return None
    z = np.broadcast_to(z.astype(np.float32), s.shape)
    if np.array_equal(z, np.round(z)):
        return None  # integer zero points (Q4_0's 8) already take the fast kernels
    block = int(codes.get_partial_shape()[2].get_length())
    return _Q4(codes, scale, reshape.input_value(1), (-z * s.astype(np.float32))[..., 0], block, sub, z, code_type)


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def constant_value(output: ov.Output) -> np.ndarray | None:
    """The value of a subgraph of constants (what the plugin folds), evaluated by OpenVINO's own
    reference implementations; None when it reads a parameter."""
    node = output.get_node()
    if node.get_type_name() == "Parameter":
        return None
    if node.get_type_name() == "Constant":
        return _as_f32_or_int(node)
    inputs = []
    for value in node.input_values():
        v = constant_value(value)
        if v is None:
            return None
        inputs.append(ov.Tensor(np.ascontiguousarray(v)))
    outs = [ov.Tensor(node.get_output_element_type(i), node.get_output_shape(i)) for i in range(node.get_output_size())]
    if not node.evaluate(outs, inputs):
        return None
    return np.array(outs[output.get_index()].data)


def _as_f32_or_int(node: ov.Node) -> np.ndarray:
    kind = node.get_output_element_type(0)
    if kind in (ov.Type.u2, ov.Type.u4):
        bits = 2 if kind == ov.Type.u2 else 4
        shape = list(node.get_output_shape(0))
        raw = np.array(node.get_tensor_view().data).view(np.uint8).reshape(-1)
        return unpack_codes(raw[None, :], bits)[0, :int(np.prod(shape))].reshape(shape)
    if kind == ov.Type.bf16:
        bits16 = np.array(node.get_tensor_view().data).view(np.uint16)
        return (bits16.astype(np.uint32) << 16).view(np.float32)
    return np.array(node.get_data())
