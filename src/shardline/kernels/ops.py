"""The two ops as a graph names them (type GgufMatMul / GgufGather, version "shardline"), their
attributes, and their Python declarations.

A declaration computes nothing: it lets the export build and save a graph with the ops, and lets
a process without the built library read such a graph, to replace every op by the plugin's own
form (stage/block_ops.py) before compiling. With the library loaded, the C++ ops (src/) are what
the graph reads as, and what a CPU runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino as ov

from shardline.errors import ShardlineError

VERSION = "shardline"
# GGML's type ids (ggml.h), the ops' `type` attribute: the types the kernels take.
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
            "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}
# (values, bytes) per block.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
          "MXFP4": (32, 17)}


def row_bytes(kind: str, cols: int) -> int:
    values, size = BLOCKS[kind]
    return cols // values * size


def check_blocks(name: str, kind: str, shape: tuple[int, ...], rows: int, cols: int) -> None:
    """A block tensor must be exactly `rows` rows of `cols` values of `kind`, else refused by name."""
    if kind not in BLOCKS:
        raise ShardlineError(f"tensor {name}: type {kind} has no kernel")
    values, _ = BLOCKS[kind]
    if cols <= 0 or cols % values:
        raise ShardlineError(f"tensor {name}: {cols} values a row are not whole {kind} blocks of {values}")
    want = (rows, row_bytes(kind, cols))
    if tuple(shape) != want:
        raise ShardlineError(f"tensor {name}: {list(shape)} bytes of {kind} blocks, but {rows} rows of {cols} "
                             f"values take {list(want)}")


class _Declared(ov.Op):
    """What both declarations share: three integer attributes and a checked block input."""

    OP = ""
    BLOCK_INPUT = 0

    def __init__(self, inputs: list[ov.Output] | None = None, attrs: dict[str, Any] | None = None) -> None:
        self._attrs: dict[str, Any] = dict(attrs or {"type": 0, "rows": 0, "cols": 0, "tensor": ""})
        super().__init__(self, inputs)

    def visit_attributes(self, visitor: Any) -> bool:
        visitor.on_attributes(self._attrs)
        return True

    def _checked(self) -> None:
        kind = TYPE_NAMES.get(int(self._attrs["type"]))
        if kind is None:
            raise ShardlineError(f"{self._attrs['tensor']}: GGUF type id {self._attrs['type']} has no kernel")
        shape = self.get_input_partial_shape(self.BLOCK_INPUT)
        static = tuple(d.get_length() for d in shape) if shape.is_static else ()
        check_blocks(str(self._attrs["tensor"]), kind, static, int(self._attrs["rows"]), int(self._attrs["cols"]))


class GgufMatMul(_Declared):
    class_type_info = ov.DiscreteTypeInfo("GgufMatMul", VERSION)
    BLOCK_INPUT = 1

    def validate_and_infer_types(self) -> None:
        self._checked()
        x = list(self.get_input_partial_shape(0))
        self.set_output_type(0, ov.Type.f32, ov.PartialShape([*x[:-1], ov.Dimension(int(self._attrs["rows"]))]))

    def clone_with_new_inputs(self, new_inputs: list[ov.Output]) -> GgufMatMul:
        return GgufMatMul(new_inputs, self._attrs)

    def get_type_info(self) -> ov.DiscreteTypeInfo:
        return GgufMatMul.class_type_info


class GgufGather(_Declared):
    class_type_info = ov.DiscreteTypeInfo("GgufGather", VERSION)

    def validate_and_infer_types(self) -> None:
        self._checked()
        ids = list(self.get_input_partial_shape(1))
        self.set_output_type(0, ov.Type.f32, ov.PartialShape([*ids, ov.Dimension(int(self._attrs["cols"]))]))

    def clone_with_new_inputs(self, new_inputs: list[ov.Output]) -> GgufGather:
        return GgufGather(new_inputs, self._attrs)

    def get_type_info(self) -> ov.DiscreteTypeInfo:
        return GgufGather.class_type_info


def block_matmul(x: ov.Output, blocks: ov.Output, kind: str, cols: int, name: str) -> ov.Output:
    """x @ W.T for W the blocks' [rows, cols] values."""
    rows = _checked_rows(blocks, kind, cols, name)
    op = GgufMatMul([x, blocks], {"type": TYPE_IDS[kind], "rows": rows, "cols": cols, "tensor": name})
    op.set_friendly_name(name)
    return op.output(0)


def block_gather(blocks: ov.Output, ids: ov.Output, kind: str, cols: int, name: str) -> ov.Output:
    """The ids' rows of the blocks as f32 (ids i64)."""
    rows = _checked_rows(blocks, kind, cols, name)
    op = GgufGather([blocks, ids], {"type": TYPE_IDS[kind], "rows": rows, "cols": cols, "tensor": name})
    op.set_friendly_name(name)
    return op.output(0)


def _checked_rows(blocks: ov.Output, kind: str, cols: int, name: str) -> int:
    shape = tuple(int(d.get_length()) for d in blocks.get_partial_shape())
    check_blocks(name, kind, shape, shape[0] if shape else 0, cols)
    return shape[0]


def is_block_op(node: ov.Node) -> bool:
    return node.get_type_name() in ("GgufMatMul", "GgufGather") and node.get_type_info().version_id == VERSION


def blocks_of(node: ov.Node) -> tuple[str, np.ndarray, int, int]:
    """A block op's (type name, the u8 [rows, row bytes] blocks, rows, cols), checked."""
    attrs = node.get_attributes()
    kind = TYPE_NAMES.get(int(attrs["type"]))
    src = node.input_value(1 if node.get_type_name() == "GgufMatMul" else 0).get_node()
    if kind is None or src.get_type_name() != "Constant":
        raise ShardlineError(f"{node.get_friendly_name()}: not a block op over a constant of a known type")
    data = src.get_data()
    rows, cols = int(attrs["rows"]), int(attrs["cols"])
    check_blocks(node.get_friendly_name(), kind, tuple(data.shape), rows, cols)
    return kind, data.view(np.uint8), rows, cols
