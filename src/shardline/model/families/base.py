"""What an architecture declares: where its files call it, which tensors its layers have, and
how one decoder layer is built, in terms of a graph builder's primitives (LayerOps).

The model plane knows no OpenVINO: a layer is written against LayerOps, which export/graph.py
implements with OpenVINO ops. Adding an architecture is one module in this package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# Every linear of a Llama-style layer, by its Hugging Face module.
LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NORMS = ("input_layernorm", "post_attention_layernorm")
# Per-head RMSNorm of queries and keys before rotary positions (Qwen3): one weight of head_dim each.
HEAD_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# A mixture of experts' router ([experts, hidden]) and its experts' stacked matrices
# ([experts, expert_ffn, hidden] for gate and up, [experts, hidden, expert_ffn] for down).
MOE_TENSORS = ("mlp.gate.weight", "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
               "mlp.experts.down_proj.weight")
# gpt-oss's biases on them: [experts], [experts, expert_ffn] twice, [experts, hidden].
MOE_BIASES = ("mlp.gate.bias", "mlp.experts.gate_proj.bias", "mlp.experts.up_proj.bias",
              "mlp.experts.down_proj.bias")
SINKS = "self_attn.sinks.weight"  # one learned logit per query head (gpt-oss)


class LayerOps(Protocol):
    """The primitives a layer is made of. Values are the builder's (graph outputs)."""

    def rms(self, x: Any, weight: str) -> Any: ...

    def head_rms(self, x: Any, weight: str) -> Any:
        """RMSNorm of each head of x ([B, T, heads * head_dim]) over its head_dim values, by one
        weight of head_dim shared by the heads."""
        ...

    def linears(self, x: Any, prefix: str, names: tuple[str, ...]) -> list[Any]:
        """x @ W.T (+ bias) for the weights `prefix + name` that share the input x."""
        ...

    def linear(self, x: Any, name: str) -> Any: ...

    def attention(self, q: Any, k: Any, v: Any, layer: int) -> Any:
        """Rotary positions, this layer's KV cache, causal masked attention: [B, T, heads*D]."""
        ...

    def add(self, a: Any, b: Any) -> Any: ...

    def mul(self, a: Any, b: Any) -> Any: ...

    def silu(self, x: Any) -> Any: ...

    def moe(self, x: Any, prefix: str) -> Any:
        """A mixture of experts at `prefix` (its router `gate` and `experts.{gate,up,down}_proj`):
        softmax router, the top experts_used, their weights renormalised, SwiGLU experts."""
        ...

    def moe_oai(self, x: Any, prefix: str) -> Any:
        """gpt-oss's mixture: biases on the router and experts, a softmax over the chosen
        experts' logits, a clamped SwiGLU."""
        ...

    def gelu(self, x: Any) -> Any:
        """GELU, tanh approximation (Gemma's gate; PyTorch's gelu(approximate="tanh"))."""
        ...


Layer = Callable[[LayerOps, Any, int], Any]


@dataclass(frozen=True)
class Windows:
    """How a family's files lay out local (sliding-window) and global layers, as llama.cpp reads
    them (llama_hparams::set_swa_pattern): with a pattern n, layer i is local unless
    i % n == n - 1 (n = 0: every layer local). A file may give its own pattern
    ({arch}.attention.sliding_window_pattern: n, or one bool per layer) and local rotary base
    ({arch}.rope.freq_base_swa); local layers never take the linear rotary scaling."""

    pattern: int
    local_rope_theta: float | None = 10000.0  # None: the global layers' rotary (YaRN included)


def default_query_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float | None:
    return None  # 1 / sqrt(head_dim)


@dataclass(frozen=True)
class Family:
    name: str  # Arch.family
    gguf_archs: tuple[str, ...]  # general.architecture values it reads
    hf_model_types: tuple[str, ...]  # config.json model_type values it reads
    layer: Layer
    # llama.cpp's converter interleaves each Q/K head's rows for its NORM-style rotary kernel
    # (Llama); NEOX-style architectures (Qwen2) keep Hugging Face's order.
    gguf_qk_permuted: bool = True
    required_biases: tuple[str, ...] = ()  # linears that always have a bias
    hf_biases: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda cfg: ()
    head_norms: bool = False  # its layers have HEAD_NORMS
    norms: tuple[str, ...] = NORMS  # its per-layer norms before attention and the MLP
    extra_norms: tuple[str, ...] = ()  # more per-layer norms of `hidden` weights (Gemma's post-norms)
    scaled_embedding: bool = False  # the embeddings are multiplied by sqrt(hidden) (Gemma)
    # Local and global layers (None: every layer global; a window in a file then caps the context).
    windows: Windows | None = None
    # Its files may scale rotary positions by YaRN and queries by Llama 4's attention temperature,
    # with llama.cpp's keys for both (Mistral 3); elsewhere YaRN is refused.
    yarn: bool = False
    moe: bool = False  # its MLP is a mixture of experts (MOE_TENSORS)
    moe_biases: bool = False  # ... with MOE_BIASES (gpt-oss)
    sinks: bool = False  # its attention has a learned logit per head in each softmax (SINKS)
    # Its files with {arch}.expert_count > 0 are read as this family (Mixtral in a `llama` file).
    with_experts: str | None = None
    # Each expert's FFN is {arch}.feed_forward_length (llama.cpp's llama), not the file's
    # expert_feed_forward_length or, failing that, feed_forward_length / experts used (qwen3moe).
    expert_ffn_is_ffn: bool = False
    # Every n-th layer (n, 2n, ... counted from 1) has no rotary positions (SmolLM3: 4); None: all have.
    unrotated_every: int | None = None
    # The scores' scale from the file's shape (llama.cpp derives Gemma 3's from its size).
    query_scale: Callable[[int, int, int, int], float | None] = default_query_scale

    def layer_tensors(self, layer: int, biases: tuple[str, ...]) -> list[str]:
        p = f"model.layers.{layer}."
        names = [p + n + ".weight" for n in self.norms]
        dense = [x for x in LINEARS if not (self.moe and LINEARS[x] == "mlp")]
        names += [f"{p}{LINEARS[x]}.{x}.weight" for x in dense]
        if self.moe:
            names += [p + n for n in MOE_TENSORS + (MOE_BIASES if self.moe_biases else ())]
        if self.sinks:
            names.append(p + SINKS)
        names += [f"{p}{LINEARS[x]}.{x}.bias" for x in biases]
        if self.head_norms:
            names += [p + n for n in HEAD_NORMS]
        names += [p + n for n in self.extra_norms]
        return names
