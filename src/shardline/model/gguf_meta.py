"""A GGUF file's metadata -> Arch: llama.cpp's keys ({arch}.block_count, ...), checked.

What the file cannot be run as is refused here by name: mixture-of-experts, rope scalings other
than linear and rope_freqs, a vocabulary that does not match the embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.families import LINEARS, Family

Meta = Callable[[str, Any], Any]
ShapeOf = Callable[[str], "tuple[int, ...] | None"]


def _int(meta: Meta, key: str, where: str, default: int | None = None) -> int:
    value = meta(key, default)
    if value is None:
        raise ShardlineError(f"{where}: metadata {key} is missing")
    if isinstance(value, list):  # per-layer arrays (some converters write one per layer)
        if not value or len(set(value)) != 1:
            raise ShardlineError(f"{where}: {key} differs between layers ({value[:4]}...): not supported")
        value = value[0]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ShardlineError(f"{where}: metadata {key} is not a number: {value!r}") from None


def _float(meta: Meta, key: str, where: str, default: float) -> float:
    value = meta(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ShardlineError(f"{where}: metadata {key} is not a number: {value!r}") from None


def gguf_arch(meta: Meta, family: Family, shape_of: ShapeOf, rope_factors: tuple[float, ...] | None,
              where: str) -> Arch:
    a = str(meta("general.architecture", "?"))
    if (experts := meta(f"{a}.expert_count", 0)) and int(experts) > 0:
        raise ShardlineError(f"{where}: mixture-of-experts models ({int(experts)} experts) are not supported")
    tokens = meta("tokenizer.ggml.tokens", None)
    if not tokens:
        raise ShardlineError(f"{where}: metadata tokenizer.ggml.tokens is missing or empty")
    n_heads = _int(meta, f"{a}.attention.head_count", where)
    hidden = _int(meta, f"{a}.embedding_length", where)
    vocab = _vocab(meta, a, len(tokens), shape_of, where)
    context = _int(meta, f"{a}.context_length", where, 2048)
    window = meta(f"{a}.attention.sliding_window", None)
    if window is not None and int(window) < context:
        context = int(window)  # sliding attention equals full attention within its window
    return Arch(
        family=family.name,
        n_layers=_int(meta, f"{a}.block_count", where),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=_int(meta, f"{a}.attention.head_count_kv", where, n_heads),
        head_dim=_head_dim(meta, a, hidden, n_heads, where),
        intermediate=_int(meta, f"{a}.feed_forward_length", where),
        vocab=vocab,
        rope_theta=_float(meta, f"{a}.rope.freq_base", where, 10000.0),
        rms_eps=_float(meta, f"{a}.attention.layer_norm_rms_epsilon", where, 1e-5),
        tied_embeddings=shape_of("lm_head.weight") is None,
        max_context=context,
        biases=_biases(family, shape_of, where),
        rope_factors=rope_factors,
        rope_linear=_rope_linear(meta, a, where),
        sliding_window=None if window is None else int(window),
    )


def _head_dim(meta: Meta, a: str, hidden: int, n_heads: int, where: str) -> int:
    key = _int(meta, f"{a}.attention.key_length", where, 0)
    rope = _int(meta, f"{a}.rope.dimension_count", where, 0)
    head = key or rope or (hidden // n_heads if n_heads else 0)
    if rope and rope != head:
        raise ShardlineError(f"{where}: rotary positions on {rope} of {head} head dimensions are not supported")
    return head


def _vocab(meta: Meta, a: str, tokens: int, shape_of: ShapeOf, where: str) -> int:
    embedding = shape_of("model.embed_tokens.weight")
    if embedding is None:
        raise ShardlineError(f"{where}: tensor token_embd.weight is missing")
    if embedding[0] != tokens:
        raise ShardlineError(f"{where}: the vocabulary has {tokens} tokens but token_embd.weight has "
                             f"{embedding[0]} rows")
    declared = meta(f"{a}.vocab_size", None)
    if declared is not None and int(declared) != tokens:
        raise ShardlineError(f"{where}: {a}.vocab_size says {declared} but the vocabulary has {tokens} tokens")
    return tokens


def _biases(family: Family, shape_of: ShapeOf, where: str) -> tuple[str, ...]:
    """The linears whose bias layer 0 has (every layer is then checked for them)."""
    found = tuple(x for x, module in LINEARS.items() if shape_of(f"model.layers.0.{module}.{x}.bias") is not None)
    missing = [x for x in family.required_biases if x not in found]
    if missing:
        raise ShardlineError(f"{where}: a {family.name} model needs biases on {', '.join(missing)}; "
                             "they are missing")
    return found


def _rope_linear(meta: Meta, a: str, where: str) -> float | None:
    kind = meta(f"{a}.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = _float(meta, f"{a}.rope.scaling.factor", where, 1.0)
        return None if factor == 1.0 else factor
    raise ShardlineError(f"{where}: rope scaling {kind!r} is not supported (supported: none, linear, rope_freqs)")
