"""Qwen3 (dense): the Llama layer without biases, with an RMSNorm over each query and key head
before rotary positions (llama.cpp's attn_q_norm / attn_k_norm), NEOX-style rotary (the GGUF
keeps Hugging Face's Q/K row order), and a head size the file gives that need not be hidden /
heads (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024)."""

from __future__ import annotations

from typing import Any

from shardline.model.families.base import Family, LayerOps
from shardline.model.families.llama import _hf_biases


def qwen3_attention(ops: LayerOps, x: Any, i: int) -> Any:
    """Layer i's attention with q/k norms, and its residual (Qwen3-MoE's too)."""
    p = f"model.layers.{i}."
    h = ops.rms(x, p + "input_layernorm.weight")
    q, k, v = ops.linears(h, p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
    q = ops.head_rms(q, p + "self_attn.q_norm.weight")
    k = ops.head_rms(k, p + "self_attn.k_norm.weight")
    return ops.add(x, ops.linear(ops.attention(q, k, v, i), p + "self_attn.o_proj"))


def qwen3_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    x = qwen3_attention(ops, x, i)
    h = ops.rms(x, p + "post_attention_layernorm.weight")
    gate, up = ops.linears(h, p + "mlp.", ("gate_proj", "up_proj"))
    return ops.add(x, ops.linear(ops.mul(ops.silu(gate), up), p + "mlp.down_proj"))


QWEN3 = Family(name="qwen3", gguf_archs=("qwen3",), hf_model_types=("qwen3",), layer=qwen3_layer,
               gguf_qk_permuted=False, hf_biases=_hf_biases, head_norms=True)
FAMILIES = (QWEN3,)
