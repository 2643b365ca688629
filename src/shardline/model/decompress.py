"""A file's stored weights as OpenVINO constants plus the decompression subgraph the CPU plugin
fuses into its compressed matmuls (and gathers), so the weights stay as the file has them.

A group-quantized matrix (model/quant.py) becomes

    Reshape(Multiply(Subtract(Convert(codes), z), s), [rows, cols])

with codes u2/u4/u8/i8 [rows, groups, G] and s, z per group [rows, groups, 1]. For a matmul, s
and z are themselves small subgraphs of the file's own numbers (f16 super-scales times integer
sub-block scales, z = zero - offset / s), which the plugin folds into f32 constants at load:
the shard stays about the file's size, and the values are the file's to f32 rounding
(w = s*q + offset is computed as s*(q - z) with z = -offset/s). A gather (the token
embedding) needs s and z as plain constants (the plugin's gather fusion matches nothing else),
so there they are computed here, with the same f32 operations, and its u2 codes are widened to
u4 (it has no u2 gather).

A group whose scale is 0 decodes to its offset whatever its codes: its codes are stored as 0
and its scale taken as |offset| / 8 (or 1 when the offset is 0 too), so z = -offset/s (+-8 or 0)
and the group still decodes to exactly its offset.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.model.quant import GroupQuant, HalfFloat, pack_codes, repack_codes

_OV_CODES = {"u2": ov.Type.u2, "u4": ov.Type.u4, "u8": ov.Type.u8, "i8": ov.Type.i8}


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def shared_constant(a: np.ndarray, shape: list[int], kind: ov.Type, keep: list[np.ndarray] | None,
                    name: str) -> ov.Node:
    """A constant over the array's own memory (no copy): `keep` holds the array until the
    graph is saved (the constant does not keep it alive). keep=None: a copy the constant owns
    (a graph compiled at load, which outlives the arrays it was made from)."""
    a = np.ascontiguousarray(a)
    if keep is not None:
        keep.append(a)
    c = ov.op.Constant(ov.Tensor(a, ov.Shape(shape), kind), shared_memory=keep is not None)
    c.set_friendly_name(name)
    return c


def half_constant(h: HalfFloat, name: str, keep: list[np.ndarray] | None) -> ov.Output:
    """F16 / BF16 as a 16-bit constant converted to f32 (the plugin keeps or widens it)."""
    kind = ov.Type.f16 if h.kind == "F16" else ov.Type.bf16
    return ops.convert(shared_constant(h.bits, list(h.bits.shape), kind, keep, name), ov.Type.f32).output(0)


def group_constant(q: GroupQuant, name: str, keep: list[np.ndarray] | None, gather: bool = False) -> ov.Output:
    """The [rows, cols] f32-valued weight of a group-quantized matrix (see the module doc).
    Its codes and factors become constants over q's own arrays (which `keep` holds)."""
    flat = _flat_groups(q)
    packed, bits = _codes(q, flat, widen=gather)
    kind = _OV_CODES["i8" if q.signed else f"u{bits}"]
    codes = shared_constant(packed, [q.rows, q.groups, q.group], kind, keep, name + ".codes")
    scale, zero = _folded(q, flat, name) if gather else _factored(q, name, keep)
    x = ops.convert(codes, ov.Type.f32).output(0)
    if zero is not None:
        x = ops.subtract(x, zero).output(0)
    deq = ops.multiply(x, scale)
    return ops.reshape(deq, _i64(q.rows, q.cols), False).output(0)


def experts_constant(q: GroupQuant, experts: int, name: str, keep: list[np.ndarray] | None) -> ov.Output:
    """A mixture's stacked experts [experts, rows, cols] from their group-quantized matrix (every
    expert's rows in turn): codes [experts, rows, groups, G] (u2 widened to u4), s and z plain
    f32 constants [experts, rows, groups, 1], Reshape to [experts, rows, cols]: the form the CPU
    plugin folds into its compressed GatherMatmul (docs/research/moe-openvino.md)."""
    flat = _flat_groups(q)
    packed, bits = _codes(q, flat, widen=True)
    kind = _OV_CODES["i8" if q.signed else f"u{bits}"]
    rows = q.rows // experts
    codes = shared_constant(packed, [experts, rows, q.groups, q.group], kind, keep, name + ".codes")
    scale, zero = _folded_arrays(q, flat)
    x = ops.convert(codes, ov.Type.f32).output(0)
    if zero is not None:
        z = zero.reshape(experts, rows, q.groups, 1) if isinstance(zero, np.ndarray) else np.float32(zero)
        x = ops.subtract(x, ops.constant(z, name=name + ".zp")).output(0)
    deq = ops.multiply(x, ops.constant(scale.reshape(experts, rows, q.groups, 1), name=name + ".scale"))
    return ops.reshape(deq, _i64(experts, rows, q.cols), False).output(0)


def _flat_groups(q: GroupQuant) -> np.ndarray | None:
    """Groups with an offset whose scale is 0: they decode to their offset, so their codes are
    stored as 0 (a scale made nonzero must not bring the codes back)."""
    if q.group_min is None:
        return None
    flat = q.scale() == 0
    return flat if flat.any() else None


def _codes(q: GroupQuant, flat: np.ndarray | None, widen: bool) -> tuple[np.ndarray, int]:
    """The packed codes [rows, groups, group bytes]; flat groups' codes zeroed in place (each
    group's codes are whole bytes of its own, and only the export holds this GroupQuant)."""
    packed = q.packed.reshape(q.rows, q.groups, -1)
    if flat is not None:
        packed[flat] = 0
    if widen and q.bits == 2:  # no u2 gather: u4
        return repack_codes(q.packed, 2, 4).reshape(q.rows, q.groups, -1), 4
    return packed, q.bits


def _folded(q: GroupQuant, flat: np.ndarray | None, name: str) -> tuple[ov.Output, ov.Output | None]:
    """s and z as f32 constants [rows, groups, 1]."""
    scale, zero = _folded_arrays(q, flat)
    z = None if zero is None else ops.constant(zero[..., None] if isinstance(zero, np.ndarray) else np.float32(zero),
                                               name=name + ".zp").output(0)
    return ops.constant(scale[..., None], name=name + ".scale").output(0), z


def _folded_arrays(q: GroupQuant, flat: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | int | None]:
    """s [rows, groups] f32, and z: [rows, groups] f32 for the types with an offset, else the
    types' fixed zero code (or None)."""
    scale, offset = q.scale(), q.offset()
    if offset is None:
        return scale, q.zero or None
    if flat is not None:
        scale = np.where(flat, np.abs(offset) / np.float32(8), scale).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    return scale, (np.float32(q.zero) - offset / scale).astype(np.float32)


def _factored(q: GroupQuant, name: str, keep: list[np.ndarray] | None) -> tuple[ov.Output, ov.Output | None]:
    """s and z as subgraphs of the stored factors, [rows, groups, 1] (folded by the plugin)."""
    scale = _product(q, q.super_scale, q.group_scale, name + ".scale", keep)
    if q.group_min is None:
        zero = ops.constant(np.float32(q.zero)).output(0) if q.zero else None
        return scale, zero
    offset = ops.multiply(_product(q, q.super_min, q.group_min, name + ".min", keep), np.float32(q.min_sign)).output(0)
    zero_scale = ops.equal(scale, np.float32(0))
    flat = ops.select(ops.equal(offset, np.float32(0)), np.float32(1), ops.divide(ops.abs(offset), np.float32(8)))
    safe = ops.select(zero_scale, flat, scale).output(0)
    z = ops.subtract(np.float32(q.zero), ops.divide(offset, safe)).output(0)
    return safe, z


def _product(q: GroupQuant, coarse: np.ndarray | None, fine: np.ndarray, name: str,
             keep: list[np.ndarray] | None) -> ov.Output:
    """coarse[r, g // sub] * fine[r, g] as f32 [rows, groups, 1]."""
    f = ops.convert(_small_constant(fine, name, keep), ov.Type.f32)
    if coarse is None:
        return ops.reshape(f, _i64(q.rows, q.groups, 1), False).output(0)
    c = ops.convert(shared_constant(coarse, [q.rows, coarse.shape[1], 1], ov.Type.f16, keep, name + ".super"),
                    ov.Type.f32)
    fine3 = ops.reshape(f, _i64(q.rows, q.groups // q.sub, q.sub), False)
    return ops.reshape(ops.multiply(c, fine3), _i64(q.rows, q.groups, 1), False).output(0)


_NUMPY_TYPES = {np.dtype(np.float16): ov.Type.f16, np.dtype(np.uint8): ov.Type.u8, np.dtype(np.int8): ov.Type.i8,
                np.dtype(np.float32): ov.Type.f32}  # f32: MXFP4's e8m0 scales (2^-127..2^127, past f16)


def _small_constant(a: np.ndarray, name: str, keep: list[np.ndarray] | None) -> ov.Node:
    """f16 as f16; integer sub-block factors in as few bits as they take (u4 for 4-bit ones)."""
    if a.dtype == np.uint8 and a.shape[-1] % 2 == 0 and int(a.max(initial=0)) < 16:
        return shared_constant(pack_codes(a, 4), list(a.shape), ov.Type.u4, keep, name)
    return shared_constant(a, list(a.shape), _NUMPY_TYPES[a.dtype], keep, name)
