"""`--weights gguf` keeps the file's own quantized blocks; our dequantization matches the
gguf package's and transformers' own GGUF loader (which also checks the Q/K un-permutation)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from shardline.config import RunConfig
from shardline.kernels.load import attach
from shardline.model.manifest import load_manifest
from shardline.model.quant import GroupQuant
from shardline.model.source import default_model_path, open_source
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.stage.block_ops import plugin_form, read_stage
from shardline.stage.zero_points import split_zero_points
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours


def _raw(name: str) -> tuple[np.ndarray, str]:
    t = next(t for t in GGUFReader(str(default_model_path())).tensors if t.name == name)
    return np.asarray(t.data), t.tensor_type.name


@pytest.mark.parametrize("hf,gguf_name", [
    ("model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"),
    ("model.layers.3.self_attn.v_proj.weight", "blk.3.attn_v.weight"),
    ("model.embed_tokens.weight", "token_embd.weight"),
])
def test_blocks_dequantize_exactly_like_gguf(hf: str, gguf_name: str) -> None:
    source = open_source(None)
    blocks = source.stored(hf)
    assert isinstance(blocks, GroupQuant)
    data, kind = _raw(gguf_name)
    assert blocks.kind == kind
    expect = dequantize(data, getattr(__import__("gguf").GGMLQuantizationType, kind))
    np.testing.assert_array_equal(blocks.dequantize(), expect.reshape(blocks.dequantize().shape))


def test_exported_blocks_are_the_files_bytes_and_the_plugin_form_its_codes_and_scales(
        shards: Callable[..., Path]) -> None:
    """The shard holds the file's blocks byte for byte under shardline's ops (Q and K rows
    un-permuted, whole rows moved); read for the plugin (exact), each op becomes the file's own
    codes and f16 scales (model/decompress.py), nothing widened."""
    folder = shards("gguf", stages=2)
    core = ov.Core()
    attach(core)
    model = core.read_model(folder / "stage0.xml")
    consts = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    down, kind = _raw("blk.3.ffn_down.weight")
    np.testing.assert_array_equal(consts["model.layers.3.mlp.down_proj.weight.blocks"].get_data(),
                                  down.reshape(consts["model.layers.3.mlp.down_proj.weight.blocks"].get_data().shape))
    source = open_source(None)
    q = source.blocks("model.layers.3.self_attn.q_proj.weight")
    assert q is not None and q.kind == kind == "Q4_1"
    stacked = consts["model.layers.3.self_attn.q_proj.weight|model.layers.3.self_attn.k_proj.weight|"
                     "model.layers.3.self_attn.v_proj.weight.blocks"].get_data()
    np.testing.assert_array_equal(stacked[:q.rows], q.data)
    assert {n.get_type_name() for n in model.get_ops()} >= {"GgufMatMul", "GgufGather"}

    assert plugin_form(model) > 0 and not any(n.get_type_name().startswith("Gguf") for n in model.get_ops())
    consts = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    blocks = source.stored("model.layers.3.mlp.down_proj.weight")
    assert isinstance(blocks, GroupQuant)
    codes = consts["model.layers.3.mlp.down_proj.weight.codes"]
    assert codes.get_element_type() == ov.Type.u4
    packed = codes.get_data().view(np.uint8)  # two codes per byte, low nibble first
    unpacked = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(blocks.rows, blocks.groups, blocks.group)
    np.testing.assert_array_equal(unpacked, blocks.codes())
    scale = consts["model.layers.3.mlp.down_proj.weight.scale"]  # the file's f16 d, as they are
    np.testing.assert_array_equal(scale.get_data().reshape(blocks.group_scale.shape).view(np.uint16),
                                  blocks.group_scale.view(np.uint16))
    emb = consts["model.embed_tokens.weight.gather.codes"]
    assert emb.get_element_type() == ov.Type.i8  # Q8_0 stays 8-bit


def test_q_and_k_unpermuted_like_transformers() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = open_source(None)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.7.mlp.up_proj.weight", "model.norm.weight"):
        np.testing.assert_allclose(ours.tensor(name), hf.state_dict()[name].numpy(), atol=1e-6, rtol=0)


def test_fast_precision_splits_the_q4_1_zero_points_and_tokens_do_not_depend_on_the_split(
        shards: Callable[..., Path]) -> None:
    """`--precision fast` without the kernels rewrites every Q4_1 matmul of the plugin's form
    (stage/zero_points.py) so that its activations may be quantized; as in every precision, 2
    stages give the tokens of 1."""
    two, one = shards("gguf", stages=2), shards("gguf", stages=1)
    manifest = load_manifest(two)
    first = manifest.stages[0]
    model, _ = read_stage(ov.Core(), two / first.xml, RunConfig(precision="rounded"))  # the plugin's form
    # per layer: q|k|v stacked, o, gate|up stacked, down (the head is Q8_0: no zero point)
    assert split_zero_points(model) == 4 * (first.last_layer - first.first_layer + 1)
    prompt = ChatTokenizer(one).encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    fast = RunConfig(precision="fast", threads=2)
    with LocalPipeline(one, fast) as p1, LocalPipeline(two, fast) as p2:
        assert greedy_ours(p2, prompt, 48)[0] == greedy_ours(p1, prompt, 48)[0]


def test_rounded_precision_changes_the_weights_alike_on_every_split(shards: Callable[..., Path]) -> None:
    """`--precision rounded` rounds the Q4_1 zero points at load (stage/zero_points.py): other
    weights than the file's, so another answer than `fast`'s; 2 stages still give 1 stage's."""
    two, one = shards("gguf", stages=2), shards("gguf", stages=1)
    prompt = ChatTokenizer(one).encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    rounded = RunConfig(precision="rounded", threads=2)
    with LocalPipeline(one, rounded) as p1, LocalPipeline(two, rounded) as p2:
        tokens = greedy_ours(p1, prompt, 32)[0]
        assert greedy_ours(p2, prompt, 32)[0] == tokens
    with LocalPipeline(one, RunConfig(precision="fast", threads=2)) as p:
        assert greedy_ours(p, prompt, 32)[0] != tokens
