"""Mixtral-style experts in a `llama` GGUF (Mixtral 8x7B and 8x22B, and the Llama-layered MoE
files converters write with `llama.expert_count`), as llama.cpp's llama graph runs them when a
layer has `ffn_gate_inp` (src/models/llama.cpp): Llama's attention, then a softmax router over
the experts, the top `experts_used` with their probabilities renormalised, SwiGLU experts whose
rows are the file's `feed_forward_length`. Qwen3-MoE routes the same way (llm_graph_context::
build_moe_ffn with norm_w); only the attention and the experts' width key differ."""

from __future__ import annotations

from typing import Any

from shardline.model.families.base import Family, LayerOps
from shardline.model.families.llama import _hf_biases, llama_attention


def mixtral_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    x = llama_attention(ops, x, i)
    h = ops.rms(x, p + "post_attention_layernorm.weight")
    return ops.add(x, ops.moe(h, p + "mlp."))


# No GGUF architecture of its own: a `llama` file with experts reads as this (LLAMA.with_experts).
MIXTRAL = Family(name="mixtral", gguf_archs=(), hf_model_types=(), layer=mixtral_layer, hf_biases=_hf_biases,
                 moe=True, expert_ffn_is_ffn=True)
FAMILIES = (MIXTRAL,)
