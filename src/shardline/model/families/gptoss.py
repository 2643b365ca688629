"""gpt-oss (20b, 120b), as llama.cpp runs a `gpt-oss` GGUF (src/models/openai-moe.cpp):

- attention with biases on q, k, v and o, NEOX rotary with YaRN, and a learned sink logit per
  head in every softmax (LayerOps.attention, the family's `sinks`);
- every other layer local, over the file's sliding window (layer 0 first, llama.cpp's pattern 2),
  with the same rotary as the global ones;
- the norm before the experts (llama.cpp's attn_post_norm, `post_attention_norm` in the file:
  the name Gemma 3 gives its norm after attention), then its mixture: a biased router whose top
  experts_used logits are softmaxed, experts with biases and a SwiGLU clamped at 7
  (LayerOps.moe_oai).

Its MXFP4 experts are kept exactly (model/gguf_blocks.py) and run as the CPU plugin's 2-GEMM
GatherMatmul pattern, only the chosen experts computed (export/experts.py)."""

from __future__ import annotations

from typing import Any

from shardline.model.families.base import Family, LayerOps, Windows
from shardline.model.families.llama import llama_attention


def gptoss_layer(ops: LayerOps, x: Any, i: int) -> Any:
    p = f"model.layers.{i}."
    x = llama_attention(ops, x, i)
    h = ops.rms(x, p + "self_attn.post_norm.weight")  # the file's post_attention_norm (see above)
    return ops.add(x, ops.moe_oai(h, p + "mlp."))


GPT_OSS = Family(name="gpt-oss", gguf_archs=("gpt-oss",), hf_model_types=(), layer=gptoss_layer,
                 gguf_qk_permuted=False, required_biases=("q_proj", "k_proj", "v_proj", "o_proj"),
                 norms=("input_layernorm", "self_attn.post_norm"),
                 windows=Windows(pattern=2, local_rope_theta=None), yarn=True, moe=True, moe_biases=True, sinks=True)
FAMILIES = (GPT_OSS,)
