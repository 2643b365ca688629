"""Qwen3-MoE (30B-A3B, 235B-A22B), as llama.cpp runs a `qwen3moe` GGUF (src/models/qwen3moe.cpp
and llm_graph_context::build_moe_ffn in the vendored source): Qwen3's attention (q/k norms, NEOX
rotary), then in place of the MLP a softmax router over `experts`, the top `experts_used`
chosen, their probabilities renormalised to sum to 1, SwiGLU experts of `expert_ffn` rows."""

from __future__ import annotations

from typing import Any

from shardline.model.families.base import Family, LayerOps
from shardline.model.families.llama import _hf_biases
from shardline.model.families.qwen3 import qwen3_attention


def qwen3moe_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    x = qwen3_attention(ops, x, i)
    h = ops.rms(x, p + "post_attention_layernorm.weight")
    return ops.add(x, ops.moe(h, p + "mlp."))


QWEN3MOE = Family(name="qwen3moe", gguf_archs=("qwen3moe",), hf_model_types=(), layer=qwen3moe_layer,
                  gguf_qk_permuted=False, hf_biases=_hf_biases, head_norms=True, moe=True)
FAMILIES = (QWEN3MOE,)
