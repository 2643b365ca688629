"""`export --reblock G` on the default model: each matmul's weights in the graph are the file's
blocks re-quantized by export/reblock.py (u4 codes, integer zero points, f16 scales); the export
says so (manifest, model identity); `fast` then quantizes activations in groups of G."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.export.exporter import export
from shardline.export.reblock import reblock
from shardline.model.manifest import load_manifest
from shardline.model.quant import GroupQuant
from shardline.model.source import open_source
from shardline.pipeline.local import LocalPipeline
from shardline.stage.zero_points import constant_value, uniform_group
from tests.helpers import greedy_ours

DOWN = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def reblocked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(ExportConfig(out=tmp_path_factory.mktemp("rb") / "rb64", stages=2, reblock=64, isolate=False,
                               progress=False))


def test_the_graphs_weights_are_the_files_blocks_reblocked(reblocked: Path) -> None:
    model = ov.Core().read_model(reblocked / "stage0.xml")
    blocks = open_source(None).stored(DOWN)
    assert isinstance(blocks, GroupQuant) and blocks.kind == "Q4_1"
    consts = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    codes = consts[DOWN + ".codes"]
    assert codes.get_element_type() == ov.Type.u4 and list(codes.get_output_shape(0))[2] == 64
    assert consts[DOWN + ".zp"].get_element_type() == ov.Type.u4
    assert consts[DOWN + ".scale"].get_element_type() == ov.Type.f16
    matmul = next(t.get_node() for t in codes.output(0).get_target_inputs())  # Convert -> ... -> Reshape
    while matmul.get_type_name() != "Reshape":
        matmul = next(t.get_node() for t in matmul.output(0).get_target_inputs())
    np.testing.assert_array_equal(constant_value(matmul.output(0)), reblock(blocks, 64).dequantize())


def test_the_export_says_it_was_reblocked_and_is_another_model(reblocked: Path,
                                                               shards) -> None:  # type: ignore[no-untyped-def]
    m, plain = load_manifest(reblocked), load_manifest(shards("gguf", stages=2))
    assert m.weights == "gguf" and m.group_size == 64 and m.extra["reblocked"] == 64
    assert m.stages[1].weights_kept["Q4_1>u4g64"] > 0
    assert "Q8_0" in m.stages[0].weights_kept  # the embedding's gather keeps the file's blocks
    assert m.model_hash != plain.model_hash  # a worker of one never chains with the other


def test_fast_quantizes_activations_in_the_weights_group(reblocked: Path) -> None:
    model = ov.Core().read_model(reblocked / "stage0.xml")
    assert uniform_group(model) == 64  # stage 0: every matmul re-blocked (the tied head is stage 1's)
    with LocalPipeline(reblocked, RunConfig(precision="fast")) as pipe:
        stage0 = pipe.stages[0].compiled
        assert stage0.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 64
        tokens, _ = greedy_ours(pipe, list(range(100, 120)), 8)
    assert len(tokens) == 8
