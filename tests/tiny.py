"""A tiny draft/target pair of different sizes for speculative decoding tests: two Llama-style
Hugging Face folders (random weights, fixed seeds) that share SmolLM2's tokenizer and vocabulary.

Random weights alone give next-token distributions near uniform over 49152 tokens, where a
draft is never accepted and sampling tests see noise. So both models are built around one
shared bigram "grammar": every token v has len(SUCCESSOR_WEIGHTS) likely next tokens, the same
for both models, written into the first GRAMMAR_DIM dimensions of each model's embedding and
lm_head (the draft's whole width; the target's first half). The decoder layers, random and large
enough to matter, then move those logits with the context, differently in each model. Measured
with transformers on a few prompts: the target's top-1 probability is about 0.7 on average and
the second choice often has a few percent or more (top-k sampling at temperature 1 is testable),
the draft's greedy guess is the target's greedy token at about 60-90% of positions, and the
context changes the target's argmax at about a third of them (a wrong KV cache changes tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 49152  # SmolLM2's
GRAMMAR_SEED = 0
SUCCESSOR_WEIGHTS = (1.0, 0.93, 0.86)  # logit weight of v's 1st, 2nd, 3rd successor (before the scale)


@dataclass(frozen=True)
class TinySpec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seed: int
    head_scale: float  # logit(k-th successor | v) is about head_scale * SUCCESSOR_WEIGHTS[k] * sqrt(GRAMMAR_DIM)
    layer_std: float  # std of the decoder layers' weights: how far the context moves the logits


TARGET = TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, seed=1, head_scale=3.0, layer_std=0.05)
DRAFT = TinySpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128, seed=2, head_scale=2.5, layer_std=0.06)
GRAMMAR_DIM = DRAFT.hidden  # the grammar lives in the first GRAMMAR_DIM dimensions of both models


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """Write the target and the draft under `root` (folders "target" and "draft"); returns
    (target, draft). Deterministic: the same folders, byte for byte, on every call."""
    from shardline.model.gguf_source import GGUFSource
    from shardline.model.source import default_model_path

    grammar = _grammar()
    target, draft = root / "target", root / "draft"
    for folder, spec in ((target, TARGET), (draft, DRAFT)):
        folder.mkdir(parents=True)
        _write_model(folder, spec, *grammar)
    # SmolLM2's tokenizer.json and tokenizer_config.json (chat template, special tokens), as the
    # default model's export writes them; what HFSource copies into an export.
    GGUFSource(default_model_path()).tokenizer_files(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).write_bytes((target / name).read_bytes())
    return target, draft


def _grammar() -> tuple[np.ndarray, np.ndarray]:
    """The shared bigram part: token directions [VOCAB, GRAMMAR_DIM] (standard normal) and the
    head rows [VOCAB, GRAMMAR_DIM] that point at each token's predecessors: row u is the sum of
    SUCCESSOR_WEIGHTS[k] * unit(direction of v) over the v whose k-th successor is u."""
    rng = np.random.default_rng(GRAMMAR_SEED)
    successors = [rng.permutation(VOCAB) for _ in SUCCESSOR_WEIGHTS]
    directions = rng.standard_normal((VOCAB, GRAMMAR_DIM), dtype=np.float32)
    unit = directions / np.linalg.norm(directions, axis=1, keepdims=True)
    head = np.zeros((VOCAB, GRAMMAR_DIM), dtype=np.float32)
    for perm, weight in zip(successors, SUCCESSOR_WEIGHTS, strict=True):
        head[perm] += np.float32(weight) * unit
    return directions, head


def _write_model(folder: Path, spec: TinySpec, directions: np.ndarray, grammar_head: np.ndarray) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(spec.seed)
    d, head_dim, g = spec.hidden, spec.hidden // spec.heads, GRAMMAR_DIM
    # The embedding: the grammar's directions, then (wider models) a model-specific part, read
    # only by the layers. Every entry is standard normal, so RMSNorm leaves a token's embedding
    # about as it is and the bigram logits are about head_scale * weight * sqrt(g) in every model.
    embed = np.empty((VOCAB, d), dtype=np.float32)
    embed[:, :g] = directions
    embed[:, g:] = rng.standard_normal((VOCAB, d - g), dtype=np.float32)
    head = np.zeros((VOCAB, d), dtype=np.float32)
    head[:, :g] = grammar_head * np.float32(spec.head_scale)

    def w(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(spec.layer_std)

    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head,
               "model.norm.weight": np.ones(d, dtype=np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(d, dtype=np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, dtype=np.float32),
            p + "self_attn.q_proj.weight": w(spec.heads * head_dim, d),
            p + "self_attn.k_proj.weight": w(spec.kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": w(spec.kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": w(d, spec.heads * head_dim),
            p + "mlp.gate_proj.weight": w(spec.intermediate, d),
            p + "mlp.up_proj.weight": w(spec.intermediate, d),
            p + "mlp.down_proj.weight": w(d, spec.intermediate),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": VOCAB, "hidden_size": d, "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
