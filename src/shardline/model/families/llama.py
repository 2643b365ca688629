"""Llama and the architectures that share its layer: Llama 1-3, Mistral, SmolLM, TinyLlama.

Pre-norm (RMSNorm), grouped-query attention with rotary positions, a SwiGLU MLP. Biases are
optional (Hugging Face's attention_bias / mlp_bias); Mistral's sliding window is handled as a
context limit where it binds (model/arch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardline.model.families.base import Family, LayerOps

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def llama_attention(ops: LayerOps, x: Any, i: int) -> Any:
    """Layer i's attention and its residual (Mixtral's too)."""
    p = f"model.layers.{i}."
    h = ops.rms(x, p + "input_layernorm.weight")
    q, k, v = ops.linears(h, p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
    return ops.add(x, ops.linear(ops.attention(q, k, v, i), p + "self_attn.o_proj"))


def llama_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    x = llama_attention(ops, x, i)
    h = ops.rms(x, p + "post_attention_layernorm.weight")
    gate, up = ops.linears(h, p + "mlp.", ("gate_proj", "up_proj"))
    return ops.add(x, ops.linear(ops.mul(ops.silu(gate), up), p + "mlp.down_proj"))


def _hf_biases(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    return (ATTENTION if cfg.get("attention_bias") else ()) + (MLP if cfg.get("mlp_bias") else ())


LLAMA = Family(name="llama", gguf_archs=("llama",), hf_model_types=("llama",), layer=llama_layer,
               hf_biases=_hf_biases, with_experts="mixtral")
# GGUF files of Mistral 7B and its kin say "llama": they are read as LLAMA.
MISTRAL = Family(name="mistral", gguf_archs=(), hf_model_types=("mistral",), layer=llama_layer,
                 hf_biases=_hf_biases)
FAMILIES = (LLAMA, MISTRAL)
