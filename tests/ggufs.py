"""Small GGUF files built by hand with gguf-py, as people download them: every weight type,
several architectures and tokenizers, random weights (tests only).

Everything is deterministic across machines and library versions: random values come from
SHAKE-256 bytes turned into numbers by exact integer arithmetic (not a numpy generator, whose
streams may change), and gguf-py quantizes them with IEEE f32 operations. So a file's sha256
is fixed, and the llama.cpp golden answers (tests/golden/) name the sha256 they were made on.

K-quant blocks are packed by hand: random codes and sub-block scales, then each block's f16
super-scales set so that the values have the wanted spread (gguf-py only dequantizes K-quants).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.gguf_vocab import Vocab, byte_level_vocab

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FLOATS = ("F32", "F16", "BF16")
ALL_TYPES = FLOATS + LEGACY + K_QUANTS

# Where each block keeps its f16 scale d (and min or dmin), and the mean of its (sub-scale *
# code) over its (sub-)min, so that the min can centre the values on 0 (legacy mins are added:
# a negative centre).
_LAYOUT = {  # kind: (offset of d, offset of the min or None, centre)
    "Q2_K": (80, 82, 1.5),
    "Q3_K": (108, None, 0.0),
    "Q4_K": (0, 2, 7.5),
    "Q5_K": (0, 2, 15.5),
    "Q6_K": (208, None, 0.0),
    "Q4_0": (0, None, 0.0),
    "Q4_1": (0, 2, -7.5),
    "Q5_0": (0, None, 0.0),
    "Q5_1": (0, 2, -15.5),
    "Q8_0": (0, None, 0.0),
}


def det_bytes(seed: str, n: int) -> np.ndarray:
    """n bytes that depend only on `seed`."""
    return np.frombuffer(hashlib.shake_256(seed.encode()).digest(n), dtype=np.uint8).copy()


def det_normal(seed: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """About normal (a sum of four uniform int16s), mean 0, the given std; exact arithmetic
    until the one f32 multiply at the end."""
    n = int(np.prod(shape))
    u = det_bytes(seed, 8 * n).view(np.int16).astype(np.int64).reshape(n, 4).sum(axis=1)
    sigma = 2 * 32768 / np.sqrt(3.0)  # std of a sum of four uniforms over [-32768, 32768)
    return (u.astype(np.float32) * np.float32(std / sigma)).reshape(shape)


def _ggml(kind: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[kind]


def pack_k_quant(kind: str, rows: int, cols: int, std: float, seed: str) -> np.ndarray:
    """Random K-quant blocks [rows, cols / 256 * type_size] whose values have about `std`."""
    block, size = GGML_QUANT_SIZES[_ggml(kind)]
    return random_blocks(kind, det_bytes(seed, rows * cols // block * size), rows, std)


def random_blocks(kind: str, raw: np.ndarray, rows: int, std: float, sample: int | None = None) -> np.ndarray:
    """Random bytes made blocks of `kind` [rows, row bytes]: codes and sub-scales as they come,
    each block's f16 scale (and min) set so the values have about `std`, centred on 0, each
    block's scale varied by up to 25% (one scale for every block would make identical scale
    arrays, which a serializer may store once: not what real files look like)."""
    _, size = GGML_QUANT_SIZES[_ggml(kind)]
    blocks = raw.reshape(-1, size)
    d_at, dmin_at, centre = _LAYOUT[kind]

    def put(at: int, value: np.ndarray) -> None:
        blocks[:, at:at + 2] = value.astype(np.float16).reshape(-1, 1).view(np.uint8)

    one = np.ones(len(blocks), dtype=np.float32)
    put(d_at, one)
    if dmin_at is not None:
        put(dmin_at, one * np.float32(centre))
    spread = float(dequantize(blocks[:sample], _ggml(kind)).std()) or 1.0  # sample: the first blocks only
    jitter = np.float32(0.75) + blocks[:, 4].astype(np.float32) / np.float32(510)  # byte 4: never a scale
    put(d_at, jitter * np.float32(std / spread))
    if dmin_at is not None:
        put(dmin_at, jitter * np.float32(centre * std / spread))
    return blocks.reshape(rows, -1)


def encode(kind: str, values: np.ndarray | None, rows: int, cols: int, std: float, seed: str) -> np.ndarray:
    """A tensor's bytes (or f32/f16 values) in `kind`, as GGUFWriter.add_tensor takes them."""
    if kind in K_QUANTS:
        return pack_k_quant(kind, rows, cols, std, seed)
    if kind not in ALL_TYPES:  # a type gguf-py cannot quantize (IQ4_NL): random blocks of its size
        block, size = GGML_QUANT_SIZES[_ggml(kind)]
        blocks = det_bytes(seed, rows * cols // block * size).reshape(-1, size)
        blocks[:, :2] = np.full((len(blocks), 1), std / 8, dtype=np.float16).view(np.uint8)  # its f16 d
        return blocks.reshape(rows, -1)
    if values is None:
        values = det_normal(seed, (rows, cols), std)
    if kind == "F32":
        return values.astype(np.float32)
    return quantize(values.astype(np.float32), _ggml(kind))


def decode(kind: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The f32 values a tensor's bytes stand for (gguf-py's dequantization)."""
    if kind == "F32":
        return data.astype(np.float32).reshape(rows, cols)
    return np.asarray(dequantize(data, _ggml(kind)), dtype=np.float32).reshape(rows, cols)


# Q4_K_M as llama.cpp's quantizer mixes it (simplified): most matrices Q4_K, attn_v and
# ffn_down Q6_K in the first layers, the output Q6_K.
Q4_K_M = {"*": "Q4_K", "attn_v:0": "Q6_K", "ffn_down:0": "Q6_K", "output": "Q6_K"}


@dataclass(frozen=True)
class FileSpec:
    name: str
    weights: str = "F32"  # the matrices' type ...
    mix: dict[str, str] = field(default_factory=dict)  # ... or per tensor: "kind" or "kind:layer", "*"
    arch: str = "llama"  # general.architecture
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    context: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False
    rope_freqs: bool = False  # Llama 3.1-style frequency factors as a rope_freqs.weight tensor
    biases: bool = False  # q/k/v biases (qwen2 has them)
    head_size: int | None = None  # a head size of its own (qwen3), written as key/value_length
    qk_norms: bool = False  # per-head q/k RMSNorm weights (qwen3's attn_q_norm / attn_k_norm)
    post_norms: bool = False  # norms after attention and the FFN (gemma3's post_attention_norm / post_ffw_norm)
    experts: int = 0  # a mixture of experts in place of the FFN (qwen3moe): this many, each of expert_ffn rows
    experts_used: int = 0
    expert_ffn: int = 0
    # Experts whose router rows are all the first one's: every token's probabilities tie them.
    router_ties: tuple[int, ...] = ()
    # gpt-oss's own tensors: o bias, attention sinks, router and expert biases; its pre-experts
    # norm is post_attention_norm (not ffn_norm)
    oai: bool = False
    vocab: Vocab = field(default_factory=byte_level_vocab)
    extra_keys: dict[str, object] = field(default_factory=dict)  # more or other metadata ({arch} in keys)
    vocab_rows: int | None = None  # rows of the embedding and head, if not the vocabulary's size
    seed: str = "shardline"

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def type_of(self, kind: str, layer: int | None = None) -> str:
        if not self.mix:
            return self.weights
        for key in (f"{kind}:{layer}", kind, "*"):
            if key in self.mix:
                return self.mix[key]
        return self.weights

    def with_(self, **changes: object) -> FileSpec:
        return replace(self, **changes)  # type: ignore[arg-type]


def rope_factors(n: int) -> np.ndarray:
    """Made-up frequency factors (1 for the fastest dims up to 8 for the slowest), stronger than
    Llama 3.1's so that they move logits within a short prompt."""
    return (1.0 + 7.0 * np.arange(n, dtype=np.float32) / max(n - 1, 1)).astype(np.float32)


def tensors(spec: FileSpec) -> list[tuple[str, str, int, int, float]]:
    """(gguf name, type, rows, cols, std) of every matrix, in file order."""
    h, hd = spec.hidden, spec.head_dim
    rows = spec.vocab.size if spec.vocab_rows is None else spec.vocab_rows
    out = [("token_embd.weight", spec.type_of("token_embd"), rows, h, 1.0)]
    for i in range(spec.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_q.weight", spec.type_of("attn_q", i), spec.heads * hd, h, 0.6 / np.sqrt(h)),
            (p + "attn_k.weight", spec.type_of("attn_k", i), spec.kv_heads * hd, h, 0.6 / np.sqrt(h)),
            (p + "attn_v.weight", spec.type_of("attn_v", i), spec.kv_heads * hd, h, 1.0 / np.sqrt(h)),
            (p + "attn_output.weight", spec.type_of("attn_output", i), h, spec.heads * hd, 1.0 / np.sqrt(h)),
        ]
        if spec.experts:  # the experts' matrices stacked by rows: written as [experts, rows, cols]
            e, f = spec.experts, spec.expert_ffn
            out += [
                (p + "ffn_gate_inp.weight", "F32", e, h, 1.0 / np.sqrt(h)),
                (p + "ffn_gate_exps.weight", spec.type_of("ffn_gate_exps", i), e * f, h, 1.0 / np.sqrt(h)),
                (p + "ffn_up_exps.weight", spec.type_of("ffn_up_exps", i), e * f, h, 1.0 / np.sqrt(h)),
                (p + "ffn_down_exps.weight", spec.type_of("ffn_down_exps", i), e * h, f, 1.0 / np.sqrt(f)),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", spec.type_of("ffn_gate", i), spec.ffn, h, 1.0 / np.sqrt(h)),
                (p + "ffn_up.weight", spec.type_of("ffn_up", i), spec.ffn, h, 1.0 / np.sqrt(h)),
                (p + "ffn_down.weight", spec.type_of("ffn_down", i), h, spec.ffn, 1.0 / np.sqrt(spec.ffn)),
            ]
    if not spec.tied:
        out.append(("output.weight", spec.type_of("output"), rows, h, 2.0 / np.sqrt(h)))
    return out


def _vectors(spec: FileSpec) -> list[tuple[str, np.ndarray]]:
    """Norm weights, biases and rope factors: always F32, as llama.cpp wants them."""
    h, hd = spec.hidden, spec.head_dim
    out = [("output_norm.weight", 1.0 + det_normal(spec.seed + "output_norm", (h,), 0.1))]
    for i in range(spec.layers):
        p = f"blk.{i}."
        ffn_norm = "post_attention_norm" if spec.oai else "ffn_norm"
        out += [(p + "attn_norm.weight", 1.0 + det_normal(spec.seed + p + "attn_norm", (h,), 0.1)),
                (p + f"{ffn_norm}.weight", 1.0 + det_normal(spec.seed + p + "ffn_norm", (h,), 0.1))]
        if spec.oai:
            e, f = spec.experts, spec.expert_ffn
            out += [(p + "attn_output.bias", det_normal(spec.seed + p + "obias", (h,), 0.05)),
                    (p + "attn_sinks.weight", det_normal(spec.seed + p + "sinks", (spec.heads,), 1.0)),
                    (p + "ffn_gate_inp.bias", det_normal(spec.seed + p + "rbias", (e,), 0.5)),
                    (p + "ffn_gate_exps.bias", det_normal(spec.seed + p + "gbias", (e, f), 0.05)),
                    (p + "ffn_up_exps.bias", det_normal(spec.seed + p + "ubias", (e, f), 0.05)),
                    (p + "ffn_down_exps.bias", det_normal(spec.seed + p + "dbias", (e, h), 0.05))]
        if spec.qk_norms:
            out += [(p + f"attn_{x}_norm.weight", 1.0 + det_normal(spec.seed + p + x + "norm", (hd,), 0.2))
                    for x in ("q", "k")]
        if spec.post_norms:
            out += [(p + f"{x}.weight", 1.0 + det_normal(spec.seed + p + x, (h,), 0.1))
                    for x in ("post_attention_norm", "post_ffw_norm")]
        if spec.biases:
            for x, n in (("q", spec.heads), ("k", spec.kv_heads), ("v", spec.kv_heads)):
                out.append((p + f"attn_{x}.bias", det_normal(spec.seed + p + x + "bias", (n * hd,), 0.3)))
    if spec.rope_freqs:
        out.append(("rope_freqs.weight", rope_factors(hd // 2)))
    return [(n, v.astype(np.float32)) for n, v in out]


def _metadata(w: GGUFWriter, spec: FileSpec) -> None:
    """llama.cpp's keys for the spec; `extra_keys` adds keys or overrides these ({arch} in names)."""
    keys: dict[str, object] = {
        "general.name": spec.name,
        "{arch}.context_length": spec.context,
        "{arch}.embedding_length": spec.hidden,
        "{arch}.block_count": spec.layers,
        "{arch}.feed_forward_length": spec.ffn,
        "{arch}.attention.head_count": spec.heads,
        "{arch}.attention.head_count_kv": spec.kv_heads,
        "{arch}.rope.dimension_count": spec.head_dim,
        "{arch}.rope.freq_base": float(spec.rope_theta),
        "{arch}.attention.layer_norm_rms_epsilon": float(spec.rms_eps),
        "{arch}.vocab_size": spec.vocab.size,
    }
    if spec.head_size:
        keys |= {"{arch}.attention.key_length": spec.head_dim, "{arch}.attention.value_length": spec.head_dim}
    if spec.experts:
        keys |= {"{arch}.expert_count": spec.experts, "{arch}.expert_used_count": spec.experts_used}
        if spec.arch != "llama":  # llama's experts are feed_forward_length wide (Mixtral's files)
            keys["{arch}.expert_feed_forward_length"] = spec.expert_ffn
    keys |= spec.extra_keys
    for key, value in keys.items():
        key = key.format(arch=spec.arch)
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    spec.vocab.write(w)


def write(spec: FileSpec, path: Path, *, dequantized: bool = False, split_tensors: int = 0,
          rng: np.random.Generator | None = None) -> Path:
    """Write the file (or, with `dequantized`, the same model with every tensor as F32: what
    llama.cpp runs as the exact reference). With `split_tensors`, at most that many tensors per
    part, named like llama.cpp's gguf-split (-00001-of-0000N.gguf); returns the first part.
    With `rng`, fast random blocks for large files (benchmarks: not the deterministic bytes)."""
    w = GGUFWriter(str(path), spec.arch, split_max_tensors=split_tensors)
    _metadata(w, spec)
    for name, kind, rows, cols, std in tensors(spec):
        if rng is None:
            data = encode(kind, None, rows, cols, float(std), spec.seed + name)
        else:
            data = _fast(kind, rows, cols, float(std), rng)
        if dequantized:
            data, kind = decode(kind, data, rows, cols), "F32"
        if name.endswith("ffn_gate_inp.weight") and spec.router_ties:
            data[list(spec.router_ties)] = data[spec.router_ties[0]]
        if name.endswith("_exps.weight"):  # [experts, rows, cols]
            data = data.reshape(spec.experts, rows // spec.experts, -1)
        if kind in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=_ggml(kind))
    for name, values in _vectors(spec):
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_tensors:
        return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]
    return path


def _fast(kind: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    if kind in _LAYOUT:
        block, size = GGML_QUANT_SIZES[_ggml(kind)]
        raw = rng.integers(0, 256, rows * cols // block * size, dtype=np.uint8)
        return random_blocks(kind, raw, rows, std, sample=4096)
    values = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std))
    return values if kind == "F32" else quantize(values, _ggml(kind))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def raw_blocks(kind: str, rows: int, cols: int, seed: str, std: float = 0.05) -> np.ndarray:
    """A block-quantized matrix's bytes [rows, row bytes], as a file stores it."""
    return np.ascontiguousarray(encode(kind, None, rows, cols, std, seed))
