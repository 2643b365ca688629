"""GGUF files (llama.cpp's format): metadata, tensors, quantized blocks, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.source import QuantBlocks

# GGUF tensor name (per layer or global) -> Hugging Face name.
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_KINDS = ("Q4_0", "Q4_1", "Q8_0")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved for its rotary kernel).

    llama.cpp's converter reorders each head's rows from halves [x0..x31 | x32..x63] to
    interleaved pairs; HF layout (rotate_half RoPE) needs the halves back.
    """
    rows = w.shape[0]
    head = rows // n_heads
    return w.reshape(n_heads, head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    format = "gguf"

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package raises bare ValueErrors on corrupt files
            raise ShardlineError(f"cannot read GGUF file {path}: {e}") from None
        self._tensors = {}
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
        self.arch = self._arch()

    def _meta(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self) -> Arch:
        a = self._meta("general.architecture")
        if a != "llama":
            raise ShardlineError(f"unsupported architecture {a!r} in {self.path.name}; supported: llama")
        n_heads = int(self._meta(f"{a}.attention.head_count"))
        hidden = int(self._meta(f"{a}.embedding_length"))
        return Arch(
            family="llama",
            n_layers=int(self._meta(f"{a}.block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(self._meta(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=int(self._meta(f"{a}.rope.dimension_count", hidden // n_heads)),
            intermediate=int(self._meta(f"{a}.feed_forward_length")),
            vocab=len(self._meta("tokenizer.ggml.tokens")),
            rope_theta=float(self._meta(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(self._meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            tied_embeddings="lm_head.weight" not in self._tensors,
            max_context=int(self._meta(f"{a}.context_length", 2048)),
        )

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise ShardlineError(f"tensor {name} is missing from {self.path.name}")
        return self._tensors[name]

    def _heads_for(self, name: str) -> int | None:
        if ".q_proj." in name:
            return self.arch.n_heads
        if ".k_proj." in name:
            return self.arch.n_kv_heads
        return None

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._get(name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        heads = self._heads_for(name)
        return _unpermute_rows(w, heads) if heads else w

    def blocks(self, name: str) -> QuantBlocks | None:
        t = self._get(name)
        kind = t.tensor_type.name
        if kind not in _BLOCK_KINDS:
            return None
        raw = np.asarray(t.data, dtype=np.uint8)
        rows = raw.shape[0]
        b = _split_blocks(kind, raw.reshape(rows, -1))
        heads = self._heads_for(name)
        if heads:  # the permutation moves whole rows, so blocks (along the input dim) stay intact
            b = QuantBlocks(
                b.kind, _unpermute_rows(b.q, heads), _unpermute_rows(b.scale, heads),
                _unpermute_rows(b.offset, heads), b.bits,
            )
        return b

    def tokenizer_files(self, out: Path) -> None:
        from shardline.model.tokenizer_build import build_gguf_tokenizer

        tokens = [str(t) for t in self._meta("tokenizer.ggml.tokens")]
        merges = [str(m) for m in self._meta("tokenizer.ggml.merges")]
        types = [int(t) for t in self._meta("tokenizer.ggml.token_type")]
        if self._meta("tokenizer.ggml.model") != "gpt2":
            raise ShardlineError("only byte-level BPE (gpt2-style) GGUF tokenizers are supported")
        tok = build_gguf_tokenizer(tokens, merges, types, pre=str(self._meta("tokenizer.ggml.pre", "")))
        tok.save(str(out / "tokenizer.json"))
        eos = int(self._meta("tokenizer.ggml.eos_token_id"))
        cfg = {
            "chat_template": self._meta("tokenizer.chat_template"),
            "bos_token": tokens[int(self._meta("tokenizer.ggml.bos_token_id", eos))],
            "eos_token": tokens[eos],
            "add_bos_token": bool(self._meta("tokenizer.ggml.add_bos_token", False)),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _split_blocks(kind: str, raw: np.ndarray) -> QuantBlocks:
    """Unpack GGUF blocks of 32 values: [f16 d][f16 m (Q4_1 only)][codes]."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blk = raw.reshape(rows, -1, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return QuantBlocks(kind, blk[..., 2:].view(np.int8), d, np.zeros_like(d), 8)
    packed = blk[..., 4:] if kind == "Q4_1" else blk[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # low nibbles are values 0-15
    if kind == "Q4_1":
        m = blk[..., 2:4].copy().view(np.float16)[..., 0]
        return QuantBlocks(kind, q, d, m, 4)
    return QuantBlocks(kind, q, d, (d.astype(np.float32) * -8).astype(np.float16), 4)
