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
    # YaRN as llama.cpp computes it (ggml's rope_yarn): {"factor", "original_context", "beta_fast",
    # "beta_slow", "mscale"}: frequencies ramped between interpolated and kept, cos/sin times mscale.
    rope_yarn: dict[str, float] | None = None
    # Llama 4's attention temperature (Mistral 3): queries times 1 + scale * ln(floor(pos / floor) + 1);
    # (scale, floor) or None.
    query_temperature: tuple[float, int] | None = None
    # Local layers attend to their last `sliding_window` positions alone (Gemma 3: five of every
    # six layers); the others attend to the whole context. Where every layer is local and the
    # family runs them as full attention (Mistral 7B v0.1 under llama.cpp), the source caps the
    # context at the window instead, where the two agree.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    # Local layers' own rotary base and linear scaling (Gemma 3: 10000 and none, while global
    # layers take the file's base and scaling); None: the local layers rotate as the global ones.
    local_rope_theta: float | None = None
    local_rope_linear: float | None = None
    query_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim)
    unrotated_layers: tuple[int, ...] = ()  # layers without rotary positions (SmolLM3's NoPE layers)
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma's final softcapping)
    # A mixture of experts in place of the MLP (Qwen3-MoE): `experts` FFNs of `expert_ffn` rows,
    # `experts_used` of them per token, chosen by a softmax router; 0: a dense MLP.
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

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
        if self.rope_yarn is not None and (set(self.rope_yarn) != {"factor", "original_context", "beta_fast",
                                                                    "beta_slow", "mscale"}
                                           or not self.rope_yarn["factor"] > 0
                                           or not self.rope_yarn["original_context"] >= 1):
            raise ShardlineError(f"invalid YaRN rotary scaling {self.rope_yarn}")
        if self.query_temperature is not None and not self.query_temperature[1] >= 1:
            raise ShardlineError(f"attention temperature floor {self.query_temperature[1]} must be at least 1")
        if self.rope_factors is not None and len(self.rope_factors) != self.head_dim // 2:
            raise ShardlineError(f"rope_freqs has {len(self.rope_factors)} factors; the head size "
                                 f"{self.head_dim} needs {self.head_dim // 2}")
        self._check_windows()
        if self.experts and not (1 <= self.experts_used <= self.experts and self.expert_ffn >= 1):
            raise ShardlineError(f"{self.experts_used} experts used of {self.experts} (each of {self.expert_ffn} "
                                 "rows): a token needs 1 to all of them, each at least a row")

    def _check_windows(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ShardlineError(f"sliding window {self.sliding_window}: it must be at least 1 token")
        if self.local_layers and self.sliding_window is None:
            raise ShardlineError("local (sliding-window) layers need a sliding window")
        for name, layers in (("local layers", self.local_layers), ("unrotated layers", self.unrotated_layers)):
            if any(not 0 <= i < self.n_layers for i in layers) or list(layers) != sorted(set(layers)):
                raise ShardlineError(f"{name} {list(layers)[:8]}... are not distinct layers of {self.n_layers}")
        for name, value in (("query scale", self.query_scale), ("logit softcap", self.logit_softcap),
                            ("local rotary base", self.local_rope_theta)):
            if value is not None and not value > 0:
                raise ShardlineError(f"{name} {value} must be a positive number")

    def window(self, layer: int) -> int | None:
        """The positions layer `layer` attends back to, where that is less than the context (a
        window at least as long as the context is full attention); None: the whole context."""
        w = self.sliding_window
        return w if layer in self.local_layers and w is not None and w < self.max_context else None

    def rotary(self, layer: int) -> tuple[float, float | None, bool]:
        """Layer `layer`'s rotary base, linear scaling, and whether the model's per-frequency
        scalings (Llama 3's, rope_freqs) apply to it."""
        if layer in self.local_layers and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_linear, False
        return self.rope_theta, self.rope_linear, True

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

    def layer_weights(self, active: bool = False) -> int:
        """A decoder layer's matrix weights; with `active`, only those a token reads (of a
        mixture, its router and experts_used of the experts)."""
        attn = 2 * self.hidden * self.n_heads * self.head_dim + 2 * self.hidden * self.n_kv_heads * self.head_dim
        if not self.experts:
            return attn + 3 * self.hidden * self.intermediate
        used = self.experts_used if active else self.experts
        return attn + self.hidden * self.experts + 3 * self.hidden * self.expert_ffn * used

    @property
    def weights(self) -> int:
        """Every matrix weight of the model: its layers, the embedding and (untied) the head."""
        return self.n_layers * self.layer_weights() + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def head_layers(self) -> float:
        """The lm_head's work per token in decoder layers' (for balancing stages by work per
        token): a mixture's layer counts only what a token reads."""
        return self.vocab * self.hidden / self.layer_weights(active=True)

    def layer_tensors(self, layer: int) -> list[str]:
        return self.spec.layer_tensors(layer, self.biases)

    def truncated(self, n: int) -> Arch:
        """The model made of the first `n` decoder layers, then the final norm and head (a
        self-speculation draft): the same architecture with `n` layers."""
        if not 1 <= n <= self.n_layers:
            raise ShardlineError(f"cannot keep {n} of {self.n_layers} layers")
        return replace(self, n_layers=n, local_layers=tuple(i for i in self.local_layers if i < n),
                       unrotated_layers=tuple(i for i in self.unrotated_layers if i < n))

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
        if "local_layers" not in d and d.get("sliding_window") is not None:  # manifests before per-layer windows
            d["local_layers"] = range(d["n_layers"])
        d["local_layers"] = tuple(d.get("local_layers", ()))
        d["unrotated_layers"] = tuple(d.get("unrotated_layers", ()))
        if d.get("query_temperature") is not None:
            d["query_temperature"] = (float(d["query_temperature"][0]), int(d["query_temperature"][1]))
        if d.get("rope_factors") is not None:
            d["rope_factors"] = tuple(float(x) for x in d["rope_factors"])
        return cls(**d)
