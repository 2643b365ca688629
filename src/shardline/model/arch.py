"""What a model is, independent of where its weights live or how it is split."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from shardline.errors import ShardlineError
from shardline.model.families import LINEARS, Family, family


@dataclass(frozen=True, kw_only=True)
class Arch:
    family: str  # a name in model/families (its layer and tensors)
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    max_context: int
    biases: tuple[str, ...] = ()  # the linears with a bias ("q_proj", ...)
    # Llama 3 style frequency scaling (Hugging Face's rope_scaling): {"factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}; None: plain.
    rope_llama3: dict[str, float] | None = None
    # Per-frequency divisors of RoPE's inverse frequencies (a GGUF's rope_freqs.weight: how
    # llama.cpp files carry Llama 3.1/3.2's scaling); None: all 1.
    rope_factors: tuple[float, ...] | None = None
    rope_linear: float | None = None  # linear ("position interpolation") scaling: positions / factor
    # A sliding attention window (Mistral 7B v0.1): the context is capped at it, where sliding
    # and full attention are the same thing; None: full attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        family(self.family)  # a registered architecture
        if min(self.n_layers, self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate,
               self.vocab, self.max_context) < 1:
            raise ShardlineError(f"invalid model dimensions in the {self.family} metadata: {self.dims()}")
        if self.n_heads % self.n_kv_heads:
            raise ShardlineError(f"{self.n_heads} heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ShardlineError(f"head size {self.head_dim} is odd: rotary positions need pairs")
        if unknown := set(self.biases) - set(LINEARS):
            raise ShardlineError(f"unknown biased linears {sorted(unknown)}")
        if self.rope_factors is not None and len(self.rope_factors) != self.head_dim // 2:
            raise ShardlineError(f"rope_freqs has {len(self.rope_factors)} factors; the head size "
                                 f"{self.head_dim} needs {self.head_dim // 2}")
        if self.sliding_window is not None and self.sliding_window < self.max_context:
            raise ShardlineError(f"the context {self.max_context} exceeds the sliding window {self.sliding_window}")

    def dims(self) -> str:
        return (f"{self.n_layers} layers, hidden {self.hidden}, {self.n_heads}/{self.n_kv_heads} heads of "
                f"{self.head_dim}, FFN {self.intermediate}, vocabulary {self.vocab}")

    @property
    def spec(self) -> Family:
        return family(self.family)

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def qkv_bias(self) -> bool:
        return "q_proj" in self.biases

    @property
    def head_layers(self) -> float:
        """The lm_head's weight in decoder layers (for balancing stages by work per token)."""
        attn = 2 * self.hidden * self.n_heads * self.head_dim + 2 * self.hidden * self.n_kv_heads * self.head_dim
        return self.vocab * self.hidden / (attn + 3 * self.hidden * self.intermediate)

    def layer_tensors(self, layer: int) -> list[str]:
        return self.spec.layer_tensors(layer, self.biases)

    def truncated(self, n: int) -> Arch:
        """The model made of the first `n` decoder layers, then the final norm and head (a
        self-speculation draft): the same architecture with `n` layers."""
        if not 1 <= n <= self.n_layers:
            raise ShardlineError(f"cannot keep {n} of {self.n_layers} layers")
        return replace(self, n_layers=n)

    def with_context(self, n: int) -> Arch:
        """The same model limited to a context of n tokens (at most its own)."""
        if not 1 <= n <= self.max_context:
            raise ShardlineError(f"--context {n}: the model's context is {self.max_context} tokens")
        return replace(self, max_context=n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arch:
        d = dict(d)
        d["biases"] = tuple(d.get("biases", ()))
        if d.get("rope_factors") is not None:
            d["rope_factors"] = tuple(float(x) for x in d["rope_factors"])
        return cls(**d)
