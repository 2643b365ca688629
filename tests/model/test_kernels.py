"""shardline's block ops (kernels/) inside compiled CPU graphs, against gguf-py's reading of the
same blocks: every type, 1 to 40 rows, hostile blocks and ids, and the C++ kernels under
AddressSanitizer (kernel_check: every kernel's rows at the very end of their allocations)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import pytest

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.kernels.build import build_check
from shardline.kernels.load import attach, why_not
from shardline.kernels.ops import BLOCKS, block_gather, block_matmul
from shardline.model.manifest import load_manifest
from shardline.stage.block_ops import DERIVED, read_stage, runs_ops
from shardline.stage.runner import StageRunner
from tests.ggufs import decode, raw_blocks

TYPES = sorted(BLOCKS)


def test_the_install_built_the_kernels_for_these_sources() -> None:
    """`make run` and `make test` build them (every machine here has cmake and g++): a stage that
    fell back to the plugin's matmuls here would be a broken install, not a choice."""
    assert why_not() is None


def _x_as_quantized(kind: str, x: np.ndarray) -> np.ndarray:
    """x as the op quantizes it (kernels/src/common.cpp): per block of 32 (256 for K-quants),
    d = max|x| / 127 and q = x * (1 / d) rounded to nearest even, in f32; returns d * q."""
    block = 256 if kind.endswith("_K") else 32
    b = x.reshape(-1, block).astype(np.float32)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(b * inv) * d).reshape(x.shape)


def _compiled(model: ov.Model, folder: Path) -> ov.CompiledModel:
    """Through an IR, as a stage goes: the graph built here holds the Python declarations, and
    reads back as the C++ ops."""
    ov.save_model(model, folder / "g.xml")
    core = ov.Core()
    assert attach(core)
    return core.compile_model(core.read_model(folder / "g.xml"), "CPU")


@pytest.mark.parametrize("kind", TYPES)
def test_the_op_reads_each_type_as_gguf_py_does(kind: str, tmp_path: Path) -> None:
    rows, cols = 40, 512
    blocks = raw_blocks(kind, rows, cols, f"kernels-{kind}")
    w = decode(kind, blocks, rows, cols).astype(np.float64)
    x = ops.parameter([-1, -1, cols], ov.Type.f32, name="x")
    compiled = _compiled(ov.Model([block_matmul(x.output(0), ops.constant(blocks).output(0), kind, cols, "w")], [x]),
                         tmp_path)
    rng = np.random.default_rng(0)
    for tokens in (1, 5, 40):  # a decode row, a group, a prompt chunk
        x = rng.standard_normal((2, tokens, cols)).astype(np.float32)
        got = compiled({"x": x})[0]
        want = _x_as_quantized(kind, x).astype(np.float64) @ w.T
        scale = np.abs(_x_as_quantized(kind, x)).astype(np.float64) @ np.abs(w).T
        assert got.shape == (2, tokens, rows)
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), f"{kind} {tokens} rows"


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "MXFP4"])
def test_the_gather_dequantizes_the_rows_asked_and_refuses_ids_past_the_table(kind: str, tmp_path: Path) -> None:
    rows, cols = 24, 256
    blocks = raw_blocks(kind, rows, cols, f"gather-{kind}")
    ids = ops.parameter([-1], ov.Type.i64, name="ids")
    y = block_gather(ops.constant(blocks).output(0), ids.output(0), kind, cols, "emb")
    request = _compiled(ov.Model([y], [ids]), tmp_path).create_infer_request()
    pick = np.array([3, 0, 23, 3], np.int64)
    np.testing.assert_array_equal(request.infer({"ids": pick})[0], decode(kind, blocks, rows, cols)[pick])
    for bad in (24, -1, 2**31 - 1):  # (the plugin narrows ids to i32 before the op sees them)
        with pytest.raises(RuntimeError, match="outside 0-23"):
            request.infer({"ids": np.array([1, bad], np.int64)})
    np.testing.assert_array_equal(request.infer({"ids": pick[:1]})[0], decode(kind, blocks, rows, cols)[3:4])


def test_blocks_of_the_wrong_length_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    blocks = raw_blocks("Q4_K", 8, 512, "short")
    x = ops.parameter([-1, 512], ov.Type.f32, name="x")
    with pytest.raises(ShardlineError, match=r"tensor blk\.3\.ffn_up: \[8, 287\] bytes of Q4_K blocks"):
        block_matmul(x.output(0), ops.constant(blocks[:, :-1]).output(0), "Q4_K", 512, "blk.3.ffn_up")
    # A graph that claims more values a row than its blocks hold, as a hostile IR would: the
    # C++ op refuses it as the graph is read, naming it, and the process goes on.
    y = block_matmul(x.output(0), ops.constant(blocks).output(0), "Q4_K", 512, "blk.3.ffn_up")
    ov.save_model(ov.Model([y], [x]), tmp_path / "g.xml")
    text = (tmp_path / "g.xml").read_text().replace('cols="512"', 'cols="768"')
    (tmp_path / "g.xml").write_text(text)
    core = ov.Core()
    attach(core)
    with pytest.raises(RuntimeError, match=r"blocks of blk\.3\.ffn_up are \[8,288\] bytes"):
        core.read_model(tmp_path / "g.xml")


def test_every_kernel_under_address_sanitizer(tmp_path: Path) -> None:
    """kernel_check: each (type, ISA) this CPU runs against the scalar reference, on rows of 1-48
    blocks, 1-9 weight rows by 1-7 activation rows, each buffer exactly its size."""
    check = build_check(tmp_path / "asan")
    done = subprocess.run([str(check)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 failures" in done.stdout


@pytest.mark.parametrize("run,native,kept", [
    (RunConfig(precision="fast"), True, True),
    (RunConfig(precision="fast"), False, False),  # the library is not built: the plugin's form
    (RunConfig(precision="exact"), True, False),  # bit-faithful to the f32 reference
    (RunConfig(precision="rounded"), True, False),
    (RunConfig(precision="plugin"), True, False),
    (RunConfig(precision="fast", device="GPU"), True, False),  # the ops are CPU-only
    (RunConfig(precision="fast", device="NPU"), True, False),
])
def test_where_the_ops_run(run: RunConfig, native: bool, kept: bool) -> None:
    assert runs_ops(run, native) is kept


def _layer_types(runner: StageRunner) -> set[str]:
    return {op.get_rt_info()["layerType"].astype(str) for op in runner.compiled.get_runtime_model().get_ops()}


def test_a_fast_stage_runs_the_ops_and_an_exact_one_the_plugins_matmuls(shards: Callable[..., Path]) -> None:
    folder = shards("gguf", stages=1)
    (entry,) = load_manifest(folder).stages
    fast = StageRunner(folder, entry, RunConfig(precision="fast"))
    exact = StageRunner(folder, entry, RunConfig(precision="exact"))
    assert "Reference" in _layer_types(fast)  # our ops, as the plugin runs an extension's
    assert "Reference" not in _layer_types(exact) and "FullyConnected" in _layer_types(exact)


FALLBACK = """
import logging, sys
from pathlib import Path
from shardline.config import RunConfig
from shardline.model.manifest import load_manifest
from shardline.stage.runner import StageRunner
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
folder = Path(sys.argv[1])
(entry,) = load_manifest(folder).stages
for _ in range(2):
    r = StageRunner(folder, entry, RunConfig(precision="fast"))
    kinds = {op.get_rt_info()["layerType"].astype(str) for op in r.compiled.get_runtime_model().get_ops()}
    print("Reference" in kinds, "FullyConnected" in kinds)
"""


def test_without_the_kernels_a_fast_stage_takes_the_plugins_form_and_says_why_once(
        shards: Callable[..., Path], tmp_path: Path) -> None:
    """What a machine without a compiler gets: the same shard runs, on the plugin's matmuls."""
    folder = shards("gguf", stages=1)
    env = {**os.environ, "SHARDLINE_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(folder)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "False", "True"]
    assert done.stderr.count("shardline's block kernels are off (SHARDLINE_KERNELS=0)") == 1


def test_the_plugins_form_is_made_once_beside_the_shard_and_read_mapped(shards: Callable[..., Path],
                                                                         tmp_path: Path) -> None:
    folder = tmp_path / "s"
    shutil.copytree(shards("gguf", stages=1), folder)
    exact = RunConfig(precision="exact")
    model, weights = read_stage(ov.Core(), folder / "stage0.xml", exact)
    assert weights.parent.parent == folder / DERIVED and weights.is_file()
    assert not any(n.get_type_name().startswith("Gguf") for n in model.get_ops())
    made = weights.stat().st_mtime_ns
    again, weights2 = read_stage(ov.Core(), folder / "stage0.xml", exact)
    assert weights2 == weights and weights.stat().st_mtime_ns == made  # read, not made again
    assert read_stage(ov.Core(), folder / "stage0.xml", RunConfig(precision="fast"))[1] == folder / "stage0.bin"
    # A folder it cannot write to: the form is made in memory, the stage still loads.
    shutil.rmtree(folder / DERIVED)
    (folder / DERIVED).write_text("not a folder")
    model, weights = read_stage(ov.Core(), folder / "stage0.xml", exact)
    assert weights == folder / "stage0.bin"
    assert not any(n.get_type_name().startswith("Gguf") for n in model.get_ops())
