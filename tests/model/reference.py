"""Hugging Face transformers as the independent reference, on the very same dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardline.model.arch import Arch
from shardline.model.source import ModelSource, layer_names

torch.set_num_threads(2)


def _config(arch: Arch):  # type: ignore[no-untyped-def]
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "smollm3": transformers.SmolLM3Config}[arch.family]
    kw = dict(
        vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
        num_hidden_layers=arch.n_layers, num_attention_heads=arch.n_heads,
        num_key_value_heads=arch.n_kv_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_eps,
        rope_theta=arch.rope_theta, tie_word_embeddings=arch.tied_embeddings,
        max_position_embeddings=arch.max_context, pad_token_id=None,
    )
    if arch.family in ("llama", "qwen3", "smollm3"):
        kw["attention_bias"] = arch.qkv_bias
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def reference_model(source: ModelSource):  # type: ignore[no-untyped-def]
    import transformers

    arch = source.arch
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "smollm3": transformers.SmolLM3ForCausalLM}[arch.family]
    if source.format == "hf":  # transformers reads the folder itself: an independent check of ours
        return cls.from_pretrained(source.path, attn_implementation="eager", dtype=torch.float32).eval()
    model = cls(_config(arch)).eval()
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [n for i in range(arch.n_layers) for n in layer_names(arch, i)]
    if not arch.tied_embeddings:
        names.append("lm_head.weight")
    state = {n: torch.from_numpy(np.array(source.tensor(n))) for n in names}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" for m in missing), missing
    if arch.tied_embeddings:
        model.tie_weights()
    return model


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:  # type: ignore[no-untyped-def]
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, rows = [], []
    for _ in range(n):
        row = out.logits[0, -1].float().numpy().copy()
        tokens.append(int(np.argmax(row)))
        rows.append(row)
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, np.stack(rows)


def save_tiny_hf(folder: Path, family: str, seed: int = 0, **config: object) -> Path:
    """A tiny random-config model of `family` saved in Hugging Face format, with a tokenizer;
    `config` sets more of its config (attention_bias, mlp_bias, sliding_window, rope_scaling)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    # Qwen3's head size is its own (4 heads of 32 over a hidden size of 64 here, as Qwen3-0.6B's
    # 16 of 128 over 1024), not hidden / heads.
    arch = Arch(family=family, n_layers=6, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32 if family == "qwen3" else 16,
                intermediate=128, vocab=320, rope_theta=10000.0, rms_eps=1e-6,
                biases=("q_proj", "k_proj", "v_proj") if family == "qwen2" else (),
                tied_embeddings=family in ("qwen2", "qwen3"), max_context=256)
    cfg = _config(arch)
    if family == "mistral":
        cfg.sliding_window = None
    for key, value in config.items():
        setattr(cfg, key, value)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    model = cls(cfg).eval()
    with torch.no_grad():  # random init leaves tiny weights; widen them so logits are well separated
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(arch.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "t1"}')
    return folder
