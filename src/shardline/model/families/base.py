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


Layer = Callable[[LayerOps, Any, int], Any]


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

    def layer_tensors(self, layer: int, biases: tuple[str, ...]) -> list[str]:
        p = f"model.layers.{layer}."
        names = [p + n + ".weight" for n in NORMS]
        names += [f"{p}{LINEARS[x]}.{x}.weight" for x in LINEARS]
        names += [f"{p}{LINEARS[x]}.{x}.bias" for x in biases]
        if self.head_norms:
            names += [p + n for n in HEAD_NORMS]
        return names
