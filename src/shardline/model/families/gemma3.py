"""Gemma 3 (text), as llama.cpp runs a `gemma3` GGUF (src/models/gemma3.cpp in the vendored
source): embeddings times sqrt(hidden); RMSNorm before and after attention and before and after
the MLP (the file stores Gemma's norms as 1 + w already: llama.cpp's converter adds the 1, so
they are plain RMSNorm weights here); per-head q/k RMSNorm before NEOX rotary; a GELU (tanh)
gated MLP; tied embeddings. Five of every six layers are local: they attend to a sliding window
with a rotary base of their own (10000 unless the file says) and no linear scaling; every sixth
is global. The query scale is 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer 27B
(llama.cpp's rule, after gemma_pytorch's config: its query_pre_attn_scalar).

Read from GGUF files only: Hugging Face checkpoints store the norms as w (1 + w applied at run
time), which this layer does not do."""

from __future__ import annotations

import math
from typing import Any

from shardline.model.families.base import Family, LayerOps, Windows

POST_NORMS = ("self_attn.post_norm.weight", "mlp.post_norm.weight")


def gemma3_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    h = ops.rms(x, p + "input_layernorm.weight")
    q, k, v = ops.linears(h, p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
    q = ops.head_rms(q, p + "self_attn.q_norm.weight")
    k = ops.head_rms(k, p + "self_attn.k_norm.weight")
    attn = ops.linear(ops.attention(q, k, v, i), p + "self_attn.o_proj")
    x = ops.add(x, ops.rms(attn, p + "self_attn.post_norm.weight"))
    h = ops.rms(x, p + "post_attention_layernorm.weight")  # llama.cpp's ffn_norm: before the MLP
    gate, up = ops.linears(h, p + "mlp.", ("gate_proj", "up_proj"))
    mlp = ops.linear(ops.mul(ops.gelu(gate), up), p + "mlp.down_proj")
    return ops.add(x, ops.rms(mlp, p + "mlp.post_norm.weight"))


def query_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    return 1.0 / math.sqrt(hidden // n_heads if n_layers == 62 else head_dim)


GEMMA3 = Family(name="gemma3", gguf_archs=("gemma3",), hf_model_types=(), layer=gemma3_layer,
                gguf_qk_permuted=False, head_norms=True, extra_norms=POST_NORMS, scaled_embedding=True,
                windows=Windows(pattern=6), query_scale=query_scale)
FAMILIES = (GEMMA3,)
