"""The stage graphs: inputs/outputs, stateful KV, and the fused attention-with-KV-cache node."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.config import RunConfig
from shardline.export.graph import build_stage
from shardline.export.plan import even_split
from shardline.export.stateful import make_stateful
from shardline.export.weights import Weights
from shardline.model.source import open_source
from shardline.pipeline.local import LocalPipeline
from shardline.stage.cache import KVBook
from tests.helpers import chain, greedy_ours


def _attention_nodes(beam_gather: bool) -> list[ov.Node]:
    source = open_source(None)
    plan = even_split(source.arch.n_layers, 10)[0]  # 3 layers is enough and quick
    model = make_stateful(build_stage(source.arch, plan, Weights(source, "fp32")), beam_gather)
    runtime = ov.Core().compile_model(model, "CPU").get_runtime_model()
    return [op for op in runtime.get_ops() if op.get_rt_info()["layerType"].astype(str) == "ScaledDotProductAttention"]


def test_beam_gather_gives_fused_attention_with_kv_cache() -> None:
    nodes = _attention_nodes(beam_gather=True)
    # One fused node per layer; fused with the cache it also outputs the updated K and V.
    assert len(nodes) == 3
    assert all(n.get_output_size() == 3 for n in nodes)
    assert all("kv_cache_precision" in n.get_rt_info() for n in nodes)


def test_without_beam_gather_attention_is_not_fused_with_the_cache() -> None:
    nodes = _attention_nodes(beam_gather=False)
    assert all(n.get_output_size() == 1 for n in nodes)
    assert not any("kv_cache_precision" in n.get_rt_info() for n in nodes)


def test_manifest_describes_the_stages(shards: Callable[..., Path]) -> None:
    folder = shards("fp32", stages=3)
    m = json.loads((folder / "manifest.json").read_text())
    assert [(s["first_layer"], s["last_layer"]) for s in m["stages"]] == [(0, 9), (10, 19), (20, 29)]
    first, middle, last = m["stages"]
    assert [p["name"] for p in first["inputs"]] == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    assert [p["name"] for p in middle["inputs"]][0] == "hidden_states"
    assert middle["inputs"][0]["shape"] == [None, None, 576]
    assert [p["name"] for p in middle["outputs"]] == ["out_hidden"]
    assert [p["name"] for p in last["inputs"]] == ["hidden_states", "attention_mask", "position_ids",
                                                   "logits_index", "beam_idx"]
    assert last["outputs"] == [{"name": "logits", "dtype": "f32", "shape": [None, None, 49152]}]
    assert len(first["state"]) == 20 and "past.0.key" in first["state"]
    assert (first["has_embedding"], first["has_head"], last["has_embedding"], last["has_head"]) == (
        True, False, False, True)
    assert set(m["files"]) == {"stage0.xml", "stage0.bin", "stage1.xml", "stage1.bin", "stage2.xml",
                               "stage2.bin", "tokenizer.json", "tokenizer_config.json"}
    assert m["source"]["format"] == "gguf" and len(m["source"]["sha256"]) == 64
    assert m["versions"]["openvino"] == ov.get_version()


def test_masked_slots_and_logical_positions_keep_the_cache_coherent(shards: Callable[..., Path]) -> None:
    """A rejected draft: its slot is masked out and the position steps back; the next tokens must
    come out exactly as if the draft had never been fed."""
    stages = LocalPipeline(shards("fp32", stages=2), RunConfig(precision="exact")).stages
    prompt = [1, 4093, 198, 19556, 28, 905, 17]
    books = {"clean": KVBook(), "dirty": KVBook()}

    def step(key: str, tokens: list[int]) -> np.ndarray:
        inputs = books[key].plan(tokens)
        books[key].commit(inputs)
        return chain(stages, key, inputs)[0, -1]

    for key in books:
        for s in stages:
            s.open(key)
    expect = [step("clean", prompt)]
    step("dirty", prompt)
    step("dirty", [1234])  # a "draft" that gets rejected
    books["dirty"].mask_last(1)
    assert books["dirty"].slots == len(prompt) + 1 and books["dirty"].position == len(prompt)
    got = step("dirty", [int(np.argmax(expect[0]))])
    expect.append(step("clean", [int(np.argmax(expect[0]))]))
    np.testing.assert_allclose(got, expect[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("weights", ["fp16", "int8", "int4", "gguf"])
def test_compressed_precisions_answer_paris(weights: str, shards: Callable[..., Path]) -> None:
    from shardline.model.tokenizer import ChatTokenizer

    folder = shards(weights, stages=2)
    tok = ChatTokenizer(folder)
    pipe = LocalPipeline(folder)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = tok.decode(greedy_ours(pipe, prompt, 16)[0])
    assert "Paris" in answer
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["weights"] == weights
    assert manifest["group_size"] == (64 if weights == "int4" else None)


def test_exact_tokens_do_not_depend_on_the_split(shards: Callable[..., Path]) -> None:
    """With int8 weights, the plugin's int8 activation quantization would make tokens depend on
    the split; exact mode turns it off."""
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    one = greedy_ours(LocalPipeline(shards("int8", stages=1)), prompt, 32)[0]
    two = greedy_ours(LocalPipeline(shards("int8", stages=2)), prompt, 32)[0]
    assert one == two


def test_streams_opened_and_closed_many_times_stay_independent(shards: Callable[..., Path]) -> None:
    """Each round opens a stream, runs it with fresh arrays, and closes it: a new stream starts
    from an empty cache (same first token) and nothing of a closed request is touched again.
    (A standalone script corrupted the heap when requests fed shared-memory inputs were
    destroyed; the runner now copies its inputs.)"""
    (stage,) = LocalPipeline(shards("int8", stages=1), RunConfig(precision="fast", threads=2)).stages
    firsts = []
    for round_ in range(3):
        stage.open(round_)
        book = KVBook()
        inputs = book.plan(list(range(100, 146)))
        book.commit(inputs)
        firsts.append(int(np.argmax(stage.run(round_, inputs)[0, -1])))
        for _ in range(64):
            inputs = book.plan([5])
            book.commit(inputs)
            stage.run(round_, inputs)
        stage.close(round_)
    assert len(set(firsts)) == 1
