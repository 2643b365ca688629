"""Architectures llama.cpp runs that shardline refuses by name, each with what its layers need
that no family here builds (checked against the vendored llama.cpp's src/models/). A file of one
of them gets this reason, not a bare "unsupported"."""

from __future__ import annotations

_MOE = ("its mixture-of-experts layers (shared experts, its own routing) are not built: qwen3moe's and "
        "Mixtral-style llama experts are")
_SHARED = "its shared experts beside the routed ones are not built"
_SIGMOID = "its shared experts and sigmoid routing with per-expert biases are not built"
_MLA = ("multi-head latent attention (MLA: keys and values decompressed from one low-rank latent per token) "
        "is not built, nor are its shared experts and grouped routing")
_LINEAR = "its linear-attention layers (Gated DeltaNet, a recurrent state instead of a KV cache) are not built"

REFUSED: dict[str, str] = {
    "gemma4": ("per-layer token embeddings (a second embedding table projected into every layer), KV shared "
               "across its last layers, and head sizes that differ between local and global layers are not built"),
    "gemma3n": "per-layer embeddings, AltUp and LAuReL blocks and KV shared across layers are not built",
    "qwen3next": _LINEAR,
    "qwen35": _LINEAR,
    "qwen35moe": f"{_LINEAR}; {_MOE}",
    "qwen2moe": _MOE,
    "deepseek": _SHARED,
    "deepseek2": _MLA,
    "deepseek32": _MLA,
    "deepseek4": _MLA,
    "glm4moe": _SIGMOID,
    "llama4": f"{_SHARED}; nor are its sigmoid routing and chunked local attention",
    "dots1": _SIGMOID,
    "ernie4_5-moe": _SHARED,
    "hunyuan-moe": _SHARED,
    "granitemoe": "its embedding, residual, attention and logit scales are not built",
    "olmoe": "its routing without renormalised weights and full-width q/k norms are not built",
}
