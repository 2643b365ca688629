"""Qwen2 / Qwen2.5: the Llama layer with q, k and v biases; llama.cpp runs it with NEOX-style
rotary positions, so its GGUF keeps Hugging Face's Q/K row order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardline.model.families.base import Family
from shardline.model.families.llama import llama_layer

QKV = ("q_proj", "k_proj", "v_proj")


def _hf_biases(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    return QKV


QWEN2 = Family(name="qwen2", gguf_archs=("qwen2",), hf_model_types=("qwen2",), layer=llama_layer,
               gguf_qk_permuted=False, required_biases=QKV, hf_biases=_hf_biases)
FAMILIES = (QWEN2,)
