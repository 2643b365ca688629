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

import logging
import shutil
import tempfile
from functools import cache
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


log = logging.getLogger(__name__)
DERIVED = ".plugin-form"  # in a shard folder: its stages in the plugin's form, made on first use


def read_stage(core: ov.Core, path: Path, run: RunConfig) -> tuple[ov.Model, Path]:
    """The graph at `path` with its block ops as `run` takes them, and the weights file its
    constants map (stage/resident.py hands its pages back once the plugin has repacked them).

    The plugin's form is written once beside the shard (DERIVED, atomically) and read from there:
    its constants are then a mapped file, as a shard's are, not anonymous memory that the
    compiled model would keep for its life (1.2 GB more at idle on a 1.5B)."""
    native = attach(core)
    weights = path.with_suffix(".bin")
    model = core.read_model(path)
    if runs_ops(run, native) or not any(is_block_op(n) for n in model.get_ordered_ops()):
        return model, weights
    derived = _derived(path)
    if not derived.is_file():
        plugin_form(model)
        try:
            _save(model, derived)
        except OSError as e:  # a read-only shard folder: the form stays in memory
            _said_once(f"{path.parent} cannot keep the plugin's form of its stages ({e}): it is made at every load, "
                       f"and held in memory")
            return model, weights
        del model
    return core.read_model(derived), derived.with_suffix(".bin")


def _derived(path: Path) -> Path:
    """Where the plugin's form of the stage at `path` is kept: named by its weights file's size and
    modification time, so a shard replaced in place is never read through an older form."""
    st = path.with_suffix(".bin").stat()
    return path.parent / DERIVED / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}" / path.name


def _save(model: ov.Model, derived: Path) -> None:
    derived.parent.parent.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=derived.parent.parent, prefix=".partial-"))
    tmp.chmod(0o755)  # as the shard folder: mkdtemp makes it private
    try:
        ov.save_model(model, tmp / derived.name, compress_to_fp16=False)
        stem = derived.parent.name.rsplit("-", 2)[0]
        for old in derived.parent.parent.glob(f"{stem}-*"):  # an earlier shard's form
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(derived.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@cache
def _said_once(message: str) -> None:
    log.warning(message)


def plugin_form(model: ov.Model) -> int:
    """Every block op of `model` replaced in place by the plugin's decompression form; returns
    how many. Its constants own copies of their values (the unpacked arrays go when this
    returns): the plugin repacks the weights into its own memory as it compiles, so at idle a
    stage holds what it did before the ops existed (BENCHMARKS.md, issue 55)."""
    done = 0
    for node in [n for n in model.get_ordered_ops() if is_block_op(n)]:
        kind, data, _, _ = blocks_of(node)
        name = node.get_friendly_name()
        q = unpack(kind, data, name)  # its own arrays (group_constant edits the codes)
        if node.get_type_name() == "GgufMatMul":
            y = ops.matmul(node.input_value(0), group_constant(q, name, None), False, True)
        else:
            axis = ops.constant(np.array([0], dtype=np.int64))
            y = ops.gather(group_constant(q, name, None, gather=True), node.input_value(1), axis)
        node.output(0).replace(y.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done
