"""A stage's block ops (GgufMatMul, GgufGather: kernels/) kept, or replaced by the plugin's form.

The export writes a GGUF's block-quantized matmuls and embedding as the file's bytes under
shardline's ops. They run where the kernels do: `fast` on a CPU with the library built and
loaded (kernels/load.py), whose int8 activations are llama.cpp's own precision. Anywhere else
(`exact`, which must stay bit-faithful to an f32 reference; `rounded` and `plugin`; a GPU or NPU;
a machine where the library is not built) each op is replaced, before compiling, by the
plugin's compressed form of the same blocks (model/decompress.py): the graph then is exactly
what an export without the ops gives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.config import RunConfig
from shardline.kernels.load import attach
from shardline.kernels.ops import blocks_of, is_block_op
from shardline.model.decompress import group_constant
from shardline.model.gguf_blocks import unpack


def runs_ops(run: RunConfig, native: bool) -> bool:
    """Whether a stage run as `run` keeps the ops (given the kernels are loaded: `native`)."""
    return native and run.precision == "fast" and run.device.upper().startswith("CPU")


def read_stage(core: ov.Core, path: Path, run: RunConfig) -> tuple[ov.Model, list[np.ndarray]]:
    """The graph at `path` with its block ops as `run` takes them, and the arrays the replaced
    ops' constants are made over (they must live as long as the compiled model)."""
    native = attach(core)
    model = core.read_model(path)
    if runs_ops(run, native):
        return model, []
    return model, plugin_form(model)


def plugin_form(model: ov.Model) -> list[np.ndarray]:
    """Every block op of `model` replaced in place by the plugin's decompression form."""
    keep: list[np.ndarray] = []
    for node in [n for n in model.get_ordered_ops() if is_block_op(n)]:
        kind, data, _, _ = blocks_of(node)
        name = node.get_friendly_name()
        q = unpack(kind, np.array(data), name)  # its own arrays: group_constant edits the codes
        if node.get_type_name() == "GgufMatMul":
            y = ops.matmul(node.input_value(0), group_constant(q, name, keep), False, True)
        else:
            axis = ops.constant(np.array([0], dtype=np.int64))
            y = ops.gather(group_constant(q, name, keep, gather=True), node.input_value(1), axis)
        node.output(0).replace(y.output(0))
    if keep:
        model.validate_nodes_and_infer_types()
    return keep
