"""A GGUF file's metadata -> Arch: llama.cpp's keys ({arch}.block_count, ...), checked.

What the file cannot be run as is refused here by name: mixture-of-experts outside the families
that build them, rope scalings other than linear and rope_freqs (and YaRN where the family reads
it), a vocabulary that does not match the embedding, expert counts that do not add up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shardline.errors import ShardlineError
from shardline.model import families
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


def gguf_family(meta: Meta, where: str) -> Family:
    """The family that builds the file: by its architecture, and its experts where a family
    reads files with and without them (a `llama` file with experts is Mixtral's layer)."""
    a = str(meta("general.architecture", "?"))
    return families.for_gguf(a, where, _int(meta, f"{a}.expert_count", where, 0))


def gguf_arch(meta: Meta, family: Family, shape_of: ShapeOf, rope_factors: tuple[float, ...] | None,
              where: str) -> Arch:
    a = str(meta("general.architecture", "?"))
    if not family.moe and (experts := meta(f"{a}.expert_count", 0)) and int(experts) > 0:
        raise ShardlineError(f"{where}: mixture-of-experts models ({int(experts)} experts) are not supported")
    tokens = meta("tokenizer.ggml.tokens", None)
    if not tokens:
        raise ShardlineError(f"{where}: metadata tokenizer.ggml.tokens is missing or empty")
    n_heads = _int(meta, f"{a}.attention.head_count", where)
    hidden = _int(meta, f"{a}.embedding_length", where)
    vocab = _vocab(meta, a, len(tokens), shape_of, where)
    context = _int(meta, f"{a}.context_length", where, 2048)
    n_layers = _int(meta, f"{a}.block_count", where)
    windows = _windows(meta, a, family, n_layers, where)
    if family.windows is None and windows:  # every layer windowed, run as full attention within it
        context = min(context, windows["sliding_window"])
    if windows and rope_factors is not None:
        raise ShardlineError(f"{where}: rope_freqs factors with local (sliding-window) layers: which rotary "
                             "the local layers take is not defined; not supported")
    n_kv_heads = _int(meta, f"{a}.attention.head_count_kv", where, n_heads)
    head_dim = _head_dim(meta, a, hidden, n_heads, where)
    return Arch(
        family=family.name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        intermediate=_int(meta, f"{a}.feed_forward_length", where),
        vocab=vocab,
        rope_theta=_float(meta, f"{a}.rope.freq_base", where, 10000.0),
        rms_eps=_float(meta, f"{a}.attention.layer_norm_rms_epsilon", where, 1e-5),
        tied_embeddings=shape_of("lm_head.weight") is None,
        max_context=context,
        biases=_biases(family, shape_of, where),
        rope_factors=rope_factors,
        rope_linear=_rope_linear(meta, a, where, family),
        rope_yarn=_rope_yarn(meta, a, context, where) if family.yarn else None,
        query_temperature=_query_temperature(meta, a, context, where) if family.yarn else None,
        query_scale=family.query_scale(n_layers, hidden, n_heads, head_dim),
        unrotated_layers=_unrotated(family, n_layers),
        **(_experts(meta, a, family, where) if family.moe else {}),
        logit_softcap=_softcap(meta, a, where),
        **windows,
    )


def _windows(meta: Meta, a: str, family: Family, n_layers: int, where: str) -> dict[str, Any]:
    """The Arch fields of the file's sliding window: which layers are local, and their rotary."""
    window = meta(f"{a}.attention.sliding_window", None)
    if window is None or (family.windows is not None and window == 0):  # llama.cpp: 0 is no window
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ShardlineError(f"{where}: {a}.attention.sliding_window {window!r} is not a window of tokens")
    if family.windows is None:
        return {"sliding_window": window, "local_layers": tuple(range(n_layers))}
    theta: float | None = None
    if meta(f"{a}.rope.freq_base_swa", None) is not None or family.windows.local_rope_theta is not None:
        theta = _float(meta, f"{a}.rope.freq_base_swa", where, family.windows.local_rope_theta or 0.0)
        if not theta > 0:
            raise ShardlineError(f"{where}: {a}.rope.freq_base_swa {theta} is not a rotary base")
    local = _local_layers(meta(f"{a}.attention.sliding_window_pattern", None), family.windows.pattern, n_layers,
                          f"{where}: {a}.attention.sliding_window_pattern")
    return {"sliding_window": window, "local_layers": local, "local_rope_theta": theta, "local_rope_linear": None}


def _local_layers(pattern: Any, default: int, n_layers: int, where: str) -> tuple[int, ...]:
    """llama.cpp's layout: one bool per layer, or every n-th layer global (0: none)."""
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(x, bool) for x in pattern):
            raise ShardlineError(f"{where} must be one true/false per layer ({n_layers}), got {pattern[:8]}")
        return tuple(i for i, local in enumerate(pattern) if local)
    n = default if pattern is None else pattern
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ShardlineError(f"{where} {pattern!r} is not a layer pattern (a count, or one bool per layer)")
    return tuple(i for i in range(n_layers) if n == 0 or i % n < n - 1)


def _experts(meta: Meta, a: str, family: Family, where: str) -> dict[str, Any]:
    """A mixture of experts' counts and width, by llama.cpp's rule for the family."""
    experts = _int(meta, f"{a}.expert_count", where)
    used = _int(meta, f"{a}.expert_used_count", where)
    if not 1 <= used <= experts:
        raise ShardlineError(f"{where}: {a}.expert_used_count {used} must be in 1-{a}.expert_count ({experts})")
    ffn = _int(meta, f"{a}.feed_forward_length", where)
    if not family.expert_ffn_is_ffn:
        ffn = _int(meta, f"{a}.expert_feed_forward_length", where, 0) or ffn // used
    return {"experts": experts, "experts_used": used, "expert_ffn": ffn}


def _unrotated(family: Family, n_layers: int) -> tuple[int, ...]:
    """llama.cpp's n_no_rope_layer_step: layer i has no rotary positions where (i + 1) % n == 0."""
    n = family.unrotated_every
    return () if n is None else tuple(i for i in range(n_layers) if (i + 1) % n == 0)


def _softcap(meta: Meta, a: str, where: str) -> float | None:
    cap = _float(meta, f"{a}.final_logit_softcapping", where, 0.0)
    if cap < 0:
        raise ShardlineError(f"{where}: {a}.final_logit_softcapping {cap} is negative")
    return cap or None


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


def _rope_linear(meta: Meta, a: str, where: str, family: Family) -> float | None:
    kind = meta(f"{a}.rope.scaling.type", None)
    if kind in (None, "none") or (kind == "yarn" and family.yarn):
        return None
    if kind == "linear":
        factor = _float(meta, f"{a}.rope.scaling.factor", where, 1.0)
        return None if factor == 1.0 else factor
    raise ShardlineError(f"{where}: rope scaling {kind!r} is not supported (supported: none, linear, rope_freqs"
                         f"{', yarn' if family.yarn else ''})")


def _orig_context(meta: Meta, a: str, context: int, where: str) -> int:
    return _int(meta, f"{a}.rope.scaling.original_context_length", where, context)


def _rope_yarn(meta: Meta, a: str, context: int, where: str) -> dict[str, float] | None:
    """llama.cpp's YaRN parameters (llama_context's cparams, ggml's rope_yarn): the magnitude
    its kernel multiplies cos and sin by, once llama_context's attn_factor is folded in."""
    if meta(f"{a}.rope.scaling.type", None) != "yarn":
        return None
    factor = _float(meta, f"{a}.rope.scaling.factor", where, 0.0)
    if not factor > 0:
        raise ShardlineError(f"{where}: YaRN needs {a}.rope.scaling.factor > 0, got {factor}")
    log_mul = _float(meta, f"{a}.rope.scaling.yarn_log_multiplier", where, 0.0)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

    magnitude = mscale(1.0) / mscale(log_mul) if log_mul != 0.0 else mscale(1.0)
    return {"factor": factor, "original_context": float(_orig_context(meta, a, context, where)),
            "beta_fast": _float(meta, f"{a}.rope.scaling.yarn_beta_fast", where, 32.0),
            "beta_slow": _float(meta, f"{a}.rope.scaling.yarn_beta_slow", where, 1.0),
            "mscale": magnitude * _float(meta, f"{a}.rope.scaling.attn_factor", where, 1.0)}


def _query_temperature(meta: Meta, a: str, context: int, where: str) -> tuple[float, int] | None:
    scale = _float(meta, f"{a}.attention.temperature_scale", where, 0.0)
    return None if scale == 0.0 else (scale, _orig_context(meta, a, context, where))
