"""What a Llama-family model is, independent of where its weights live or how it is split."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from shardline.errors import ShardlineError

# Families whose decoder layer is the Llama layer; they differ only in flags captured below.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Arch:
    family: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    tied_embeddings: bool
    max_context: int
    # Llama 3 style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_llama3: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ShardlineError(
                f"unsupported architecture {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if self.n_layers < 1 or self.hidden < 1 or self.vocab < 1:
            raise ShardlineError(f"invalid model dimensions in {self.family} config")
        if self.n_heads % self.n_kv_heads:
            raise ShardlineError(f"{self.n_heads} heads are not a multiple of {self.n_kv_heads} KV heads")

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def head_layers(self) -> float:
        """The lm_head's weight in decoder layers (for balancing stages by work per token)."""
        attn = 2 * self.hidden * self.n_heads * self.head_dim + 2 * self.hidden * self.n_kv_heads * self.head_dim
        return self.vocab * self.hidden / (attn + 3 * self.hidden * self.intermediate)

    def truncated(self, n: int) -> Arch:
        """The model made of the first `n` decoder layers, then the final norm and head (a
        self-speculation draft): the same architecture with `n` layers."""
        if not 1 <= n <= self.n_layers:
            raise ShardlineError(f"cannot keep {n} of {self.n_layers} layers")
        return replace(self, n_layers=n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arch:
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Arch:
        family = str(cfg.get("model_type", "?"))
        if family not in SUPPORTED_FAMILIES:
            raise ShardlineError(
                f"unsupported architecture {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if rope_type not in (None, "default", "llama3"):
            raise ShardlineError(f"unsupported rope scaling {rope_type!r}")
        llama3 = None
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            llama3 = {k: float(scaling[k]) for k in keys}
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            family=family,
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            rope_theta=float(theta),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context=int(cfg.get("max_position_embeddings", 2048)),
            rope_llama3=llama3,
        )
