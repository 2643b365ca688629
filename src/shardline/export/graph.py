"""Build one stage's stateless OpenVINO graph: past KV in, present KV out.

The graph knows nothing about distribution: a stage is the model restricted to a layer range,
plus the embedding (stage 0) or the final norm and lm_head (last stage). `stateful.py` turns
the past/present pairs into in-graph state afterwards; `static.py` instead fixes every shape
and keeps the cache on the host (`new_kv_only`: the present KV is the new tokens' alone).

Inputs (B = batch, T = new tokens, S = physical cache length after this step):
- input_ids [B, T] i64 (stage 0) or hidden_states [B, T, hidden] f32;
- attention_mask [B, S] i64 over the *physical* cache plus the new tokens: 1 = attend,
  0 = never attend (a masked slot, e.g. a rejected draft, stays 0 for ever);
- position_ids [B, T] i64: the *logical* positions that drive RoPE (they step back after a
  rewind while the physical cache only grows);
- logits_index [B, N] i64 (last stage): the positions, among the T new ones, that get logits;
- past.{l}.key / past.{l}.value [B, kv_heads, S - T, head_dim] f32.

A local (sliding-window) layer masks, on top, every key more than its window behind the query.
A key's logical position is not an input: it is the count of attended slots before it (the
mask's running sum less one), an invariant every KV book keeps (stage/cache.py), so every path
that builds a mask (groups, speculation's masked slots, compaction, copies, imports) gets
windows right with nothing more on the wire.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.export.experts import oai_experts, routed_experts
from shardline.export.paged import PAGED_INPUTS, paged_attention
from shardline.export.plan import StagePlan
from shardline.export.weights import EMBEDDING, Linear, Weights
from shardline.kernels.ops import block_matmul
from shardline.model.arch import Arch

_NEG = float(np.finfo(np.float32).min)


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def inv_freq(arch: Arch, layer: int = 0) -> np.ndarray:
    """Layer `layer`'s RoPE inverse frequencies, with the model's scaling: Llama 3's (from its
    config, or as a GGUF's rope_freqs factors, which llama.cpp divides the frequencies by) or
    linear; a local layer's may be its own (Arch.rotary)."""
    d = arch.head_dim
    theta, linear, scaled = arch.rotary(layer)
    freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if arch.rope_factors is not None and scaled:
        freq = freq / np.asarray(arch.rope_factors, dtype=np.float64)
    if linear is not None:
        freq = freq / linear
    if arch.rope_yarn and scaled:
        freq = freq * _yarn_mix(arch.rope_yarn, d, theta)
    s = arch.rope_llama3
    if s and scaled:
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wl = 2 * np.pi / freq
        smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"]
        )
        mid = (1 - smooth) * freq / s["factor"] + smooth * freq
        freq = np.where(wl > low_wl, freq / s["factor"], np.where(wl < high_wl, freq, mid))
    return freq.astype(np.float32)


def _yarn_mix(y: dict[str, float], d: int, theta: float) -> np.ndarray:
    """YaRN's per-frequency factor, as ggml's rope_yarn mixes it (ext_factor 1): the frequencies
    below the correction range are interpolated (1 / factor), those above kept, a linear ramp
    between (ggml_rope_yarn_corr_dims)."""
    def corr_dim(rotations: float) -> float:
        return d * np.log(y["original_context"] / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low = max(0.0, float(np.floor(corr_dim(y["beta_fast"]))))
    high = min(d - 1.0, float(np.ceil(corr_dim(y["beta_slow"]))))
    i = np.arange(d // 2, dtype=np.float64)
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
    return (1 / y["factor"]) * (1 - ramp) + ramp


class _Builder:
    """Builds a stage; implements the LayerOps an architecture's layer is written in."""

    def __init__(self, arch: Arch, plan: StagePlan, w: Weights, new_kv_only: bool = False,
                 paged: bool = False) -> None:
        self.a, self.plan, self.w = arch, plan, w
        self.new_kv_only, self.paged = new_kv_only, paged
        self.paged_plan: dict[str, ov.Output] = {}  # a paged stage's batch layout (export/paged.py)
        self.params: list[ov.Node] = []
        self.results: list[ov.Node] = []
        # Shared by the layers of the stage that attend alike (made by build before the layers):
        # the masks by window (None: global), the rotary tables by inverse frequencies.
        self.masks: dict[int | None, ov.Output] = {}
        self.rotary: dict[bytes, tuple[ov.Output, ov.Output]] = {}
        self.position_ids: ov.Output | None = None

    def param(self, name: str, dtype: ov.Type, shape: list[int]) -> ov.Node:
        p = ops.parameter(ov.PartialShape(shape), dtype, name=name)
        p.output(0).set_names({name})
        self.params.append(p)
        return p

    def result(self, value: ov.Output, name: str) -> None:
        r = ops.result(value, name=name)
        r.output(0).set_names({name})
        self.results.append(r)

    def linears(self, x: ov.Output, prefix: str, names: tuple[str, ...]) -> list[ov.Output]:
        """x @ W.T (+ bias) for the weights `prefix + name` sharing the input x: one matmul over
        their stacked rows, split after (one by one when they cannot be stacked)."""
        weights = tuple(f"{prefix}{n}.weight" for n in names)
        lin = self.w.stacked(weights) if len(weights) > 1 else self.w.one(weights[0])
        if lin is None:
            outs = [self.project(x, self.w.one(w)) for w in weights]
        else:
            y = self.project(x, lin)
            outs = [y] if len(names) == 1 else list(ops.variadic_split(y, _i64(-1), _i64(*lin.rows)).outputs())
        return [ops.add(y, self.w.vector(f"{prefix}{n}.bias")).output(0) if n in self.a.biases else y
                for y, n in zip(outs, names, strict=True)]

    def linear(self, x: ov.Output, name: str) -> ov.Output:
        prefix, _, last = name.rpartition(".")
        return self.linears(x, prefix + ".", (last,))[0]

    def project(self, x: ov.Output, lin: Linear) -> ov.Output:
        if lin.kind is not None:  # the file's blocks, read by shardline's op (kernels/)
            name = lin.matrix.get_node().get_friendly_name().removesuffix(".blocks")
            return block_matmul(x, lin.matrix, lin.kind, lin.cols, name)
        return ops.matmul(x, lin.matrix, False, True).output(0)

    def rms(self, x: ov.Output, name: str) -> ov.Output:
        var = ops.reduce_mean(ops.multiply(x, x), _i64(-1), True)
        inv = ops.divide(np.float32(1.0), ops.sqrt(ops.add(var, np.float32(self.a.rms_eps))))
        return ops.multiply(ops.multiply(x, inv), self.w.vector(name)).output(0)

    def head_rms(self, x: ov.Output, name: str) -> ov.Output:
        """RMSNorm over each head's head_dim values: [B, T, n*D] -> [B, T, n, D], normed, back."""
        heads = ops.reshape(x, _i64(0, 0, -1, self.a.head_dim), True)
        return ops.reshape(self.rms(heads.output(0), name), _i64(0, 0, -1), True).output(0)

    def rope_tables(self, position_ids: ov.Output, freq: np.ndarray) -> tuple[ov.Output, ov.Output]:
        pos = ops.unsqueeze(ops.convert(position_ids, ov.Type.f32), _i64(-1))
        freqs = ops.multiply(pos, ops.constant(freq))  # [B, T, D/2]
        emb = ops.concat([freqs, freqs], -1)
        cos, sin = ops.unsqueeze(ops.cos(emb), _i64(1)), ops.unsqueeze(ops.sin(emb), _i64(1))
        if self.a.rope_yarn and self.a.rope_yarn["mscale"] != 1.0:  # YaRN's magnitude, on q and k alike
            m = np.float32(self.a.rope_yarn["mscale"])
            cos, sin = ops.multiply(cos, m), ops.multiply(sin, m)
        return cos.output(0), sin.output(0)

    def temperature(self) -> ov.Output:
        """[B, 1, T, 1]: Llama 4's query temperature by position (llama_graph's attn_temp input)."""
        assert self.position_ids is not None and self.a.query_temperature is not None
        scale, floor = self.a.query_temperature
        steps = ops.floor(ops.divide(ops.convert(self.position_ids, ov.Type.f32), np.float32(floor)))
        t = ops.add(ops.multiply(ops.log(ops.add(steps, np.float32(1.0))), np.float32(scale)), np.float32(1.0))
        return ops.unsqueeze(t, _i64(1, 3)).output(0)

    def layer_rotary(self, layer: int) -> tuple[ov.Output, ov.Output]:
        """The cos/sin tables of the layer's rotary, made once per stage for each kind."""
        assert self.position_ids is not None
        freq = inv_freq(self.a, layer)
        key = freq.tobytes()
        if key not in self.rotary:
            self.rotary[key] = self.rope_tables(self.position_ids, freq)
        return self.rotary[key]

    def rope(self, x: ov.Output, cos: ov.Output, sin: ov.Output) -> ov.Output:
        """x * cos + rotate_half(x) * sin, written as OpenVINO's RoPE fusion matches it (two
        Slices, the second half times -1, a Concat): the CPU plugin then runs one RoPE kernel
        instead of ~8 elementwise nodes per use."""
        half = self.a.head_dim // 2
        x1 = ops.slice(x, _i64(0), _i64(half), _i64(1), _i64(3))
        x2 = ops.slice(x, _i64(half), _i64(np.iinfo(np.int64).max), _i64(1), _i64(3))
        rotated = ops.concat([ops.multiply(x2, np.full((1, 1, 1, 1), -1.0, np.float32)), x1], -1)
        return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)

    def heads(self, x: ov.Output, n: int) -> ov.Output:
        """[B, T, n*D] -> [B, n, T, D]."""
        y = ops.reshape(x, _i64(0, 0, n, self.a.head_dim), True)
        return ops.transpose(y, _i64(0, 2, 1, 3)).output(0)

    def expand_kv(self, kv: ov.Output) -> ov.Output:
        """Grouped-query attention: repeat each KV head for its query heads."""
        g = self.a.group
        if g == 1:
            return kv
        x = ops.unsqueeze(kv, _i64(2))
        x = ops.broadcast(x, _i64(1, 1, g, 1, 1), broadcast_spec="BIDIRECTIONAL")
        return ops.reshape(x, _i64(0, self.a.n_heads, -1, self.a.head_dim), True).output(0)

    def allowed(self, attention_mask: ov.Output, position_ids: ov.Output) -> ov.Output:
        """[B, 1, T, S] bool: causal in *physical* slots, and never a slot masked to 0."""
        one = ops.constant(np.int64(1))
        s = ops.gather(ops.shape_of(attention_mask), one, np.int64(0))  # scalar
        t = ops.gather(ops.shape_of(position_ids), one, np.int64(0))
        keys = ops.range(np.int64(0), s, one, ov.Type.i64)  # [S]
        queries = ops.range(ops.subtract(s, t), s, one, ov.Type.i64)  # [T]: physical slots of new tokens
        causal = ops.less_equal(ops.unsqueeze(keys, _i64(0)), ops.unsqueeze(queries, _i64(1)))  # [T, S]
        keep = ops.not_equal(attention_mask, _i64(0))  # [B, S]
        return ops.logical_and(ops.unsqueeze(causal, _i64(0, 1)), ops.unsqueeze(keep, _i64(1, 2))).output(0)

    def within(self, attention_mask: ov.Output, position_ids: ov.Output, window: int) -> ov.Output:
        """[B, 1, T, S] bool: each key less than `window` positions behind each query (llama.cpp's
        standard sliding window: masked where query - key >= window). A key's position is the
        count of attended slots before it (the KV books' invariant)."""
        key_pos = ops.subtract(ops.cumsum(attention_mask, np.int64(1)), _i64(1))  # [B, S]
        behind = ops.subtract(ops.unsqueeze(position_ids, _i64(2)), ops.unsqueeze(key_pos, _i64(1)))  # [B, T, S]
        return ops.unsqueeze(ops.less(behind, _i64(window)), _i64(1)).output(0)

    def build_masks(self, attention_mask: ov.Output, position_ids: ov.Output) -> None:
        """Additive masks for the stage's layers: one per distinct window (None: global)."""
        allowed = self.allowed(attention_mask, position_ids)
        for w in sorted({self.a.window(i) for i in self.plan.layers}, key=lambda w: -1 if w is None else w):
            rule = allowed if w is None else ops.logical_and(allowed, self.within(attention_mask, position_ids, w))
            self.masks[w] = ops.select(rule, np.float32(0.0), np.float32(_NEG)).output(0)

    def add(self, a: ov.Output, b: ov.Output) -> ov.Output:
        return ops.add(a, b).output(0)

    def mul(self, a: ov.Output, b: ov.Output) -> ov.Output:
        return ops.multiply(a, b).output(0)

    def silu(self, x: ov.Output) -> ov.Output:
        return ops.swish(x).output(0)

    def moe(self, x: ov.Output, prefix: str) -> ov.Output:
        return routed_experts(self, x, prefix)

    def moe_oai(self, x: ov.Output, prefix: str) -> ov.Output:
        return oai_experts(self, x, prefix)

    def gelu(self, x: ov.Output) -> ov.Output:
        return ops.gelu(x, approximation_mode="tanh").output(0)

    @property
    def query_scale(self) -> float:
        return self.a.query_scale if self.a.query_scale is not None else float(1.0 / np.sqrt(self.a.head_dim))

    def attention(self, q: ov.Output, k: ov.Output, v: ov.Output, i: int) -> ov.Output:
        """Rotary positions, layer i's past/present KV, SDPA: [B, T, heads * D]."""
        a = self.a
        if self.paged:
            return self.paged_layer(q, k, v, i)
        mask = self.masks[a.window(i)]
        kv_shape = [-1, a.n_kv_heads, -1, a.head_dim]
        past_k = self.param(f"past.{i}.key", ov.Type.f32, kv_shape)
        past_v = self.param(f"past.{i}.value", ov.Type.f32, kv_shape)
        q, k, v = self.positioned(q, k, v, i)
        if self.new_kv_only:
            # A host-kept cache takes only the new tokens' KV out (past + new would copy the
            # whole context out of the graph every token), and attends without concatenating.
            self.result(k, f"present.{i}.key")
            self.result(v, f"present.{i}.value")
            attn = self.split_attention(q, past_k, past_v, k, v, mask)
        else:
            k_all = ops.concat([past_k, k], 2).output(0)
            v_all = ops.concat([past_v, v], 2).output(0)
            self.result(k_all, f"present.{i}.key")
            self.result(v_all, f"present.{i}.value")
            if a.spec.sinks:
                attn = self.sink_attention(q, k_all, v_all, mask, i)
            else:
                # The default scale (1 / sqrt(head_dim)) is left to the op, as the fusions expect it.
                scale = None if a.query_scale is None else ops.constant(np.float32(a.query_scale))
                attn = ops.scaled_dot_product_attention(q, self.expand_kv(k_all), self.expand_kv(v_all), mask, scale)
        return ops.reshape(ops.transpose(attn, _i64(0, 2, 1, 3)), _i64(0, 0, a.n_heads * a.head_dim), True).output(0)

    def positioned(self, q: ov.Output, k: ov.Output, v: ov.Output, i: int) -> tuple[ov.Output, ov.Output, ov.Output]:
        """Layer i's q, k, v as heads [B, n, T, D], q and k rotated to their positions (but in
        NoPE layers), q scaled by the attention temperature where the model has one."""
        a = self.a
        q, k, v = self.heads(q, a.n_heads), self.heads(k, a.n_kv_heads), self.heads(v, a.n_kv_heads)
        if i not in a.unrotated_layers:
            cos, sin = self.layer_rotary(i)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if a.query_temperature is not None:
            q = ops.multiply(q, self.temperature()).output(0)
        return q, k, v

    def paged_layer(self, q: ov.Output, k: ov.Output, v: ov.Output, i: int) -> ov.Output:
        """Layer i's attention over its block pool (export/paged.py): [1, T, heads * D]."""
        a = self.a
        q, k, v = self.positioned(q, k, v, i)
        caches = (self.param(f"key_cache.{i}", ov.Type.dynamic, [-1, -1, -1, -1]).output(0),
                  self.param(f"value_cache.{i}", ov.Type.dynamic, [-1, -1, -1, -1]).output(0))
        sinks = self.sinks(i) if a.spec.sinks else None
        out = paged_attention(q, k, v, caches, self.paged_plan, (a.n_heads, a.n_kv_heads, a.head_dim),
                              self.query_scale, a.window(i), sinks)
        return ops.unsqueeze(out, _i64(0)).output(0)

    def sinks(self, i: int) -> ov.Output:
        """Layer i's learned sink logits, one per query head: [1, heads, 1, 1]."""
        return ops.reshape(self.w.vector(f"model.layers.{i}.self_attn.sinks.weight"), _i64(1, -1, 1, 1),
                           False).output(0)

    def sink_attention(self, q: ov.Output, k: ov.Output, v: ov.Output, mask: ov.Output, i: int) -> ov.Output:
        """Attention whose softmax has one more logit per head, the layer's learned sink, which
        takes probability but gives no value (gpt-oss; llama.cpp's soft_max with sinks)."""
        k, v = self.expand_kv(k), self.expand_kv(v)  # [B, heads, S, D]
        scores = ops.add(ops.multiply(ops.matmul(q, k, False, True), np.float32(self.query_scale)), mask)
        sinks = self.sinks(i)
        column = ops.broadcast(sinks, ops.concat([ops.slice(ops.shape_of(scores), _i64(0), _i64(3), _i64(1)),
                                                  _i64(1)], 0))
        weights = ops.softmax(ops.concat([column, scores], 3), 3)
        weights = ops.slice(weights, _i64(1), _i64(np.iinfo(np.int64).max), _i64(1), _i64(3))
        return ops.matmul(weights, v, False, False).output(0)

    def split_attention(self, q: ov.Output, past_k: ov.Output, past_v: ov.Output, k: ov.Output,
                        v: ov.Output, mask: ov.Output) -> ov.Output:
        """Attention over the past (the host's ring, read in place) and the new tokens as two
        products under one softmax: concatenating the past and new KV first would copy the whole
        ring once more per layer and token (BENCHMARKS.md, issue 25). Each KV head's query heads
        are stacked as its rows ([B, kv_heads, group * T, D]) rather than the KV repeated per
        query head, which would copy the ring `group` times over; the mask rows are tiled to
        match. Only the scores ([.., group * T, ring + T]) are concatenated. [B, heads, T, D] out."""
        a = self.a
        rows = ops.reshape(q, _i64(0, a.n_kv_heads, -1, a.head_dim), True)  # heads are kv-major: h = kv * group + j
        rows = ops.multiply(rows, np.float32(self.query_scale))
        scores = ops.concat([ops.matmul(rows, past_k, False, True), ops.matmul(rows, k, False, True)], 3)
        weights = ops.softmax(ops.add(scores, ops.tile(mask, _i64(1, 1, a.group, 1))), 3)
        lengths = ops.concat([ops.gather(ops.shape_of(past_k), _i64(2), np.int64(0)),
                              ops.gather(ops.shape_of(k), _i64(2), np.int64(0))], 0)
        on_past, on_new = ops.variadic_split(weights, np.int64(3), lengths).outputs()
        out = ops.add(ops.matmul(on_past, past_v, False, False), ops.matmul(on_new, v, False, False))
        return ops.reshape(out, _i64(0, a.n_heads, -1, a.head_dim), True).output(0)

    def build(self) -> ov.Model:
        a, plan = self.a, self.plan
        # A paged stage takes one flat batch ([T] tokens of several sequences end to end), run as
        # one sequence of T ([1, T]) by everything but attention, which the plan splits.
        flat = [-1] if self.paged else [-1, -1]
        if plan.has_embedding:
            ids = self.param("input_ids", ov.Type.i64, flat).output(0)
            if self.paged:
                ids = ops.unsqueeze(ids, _i64(0)).output(0)
            x = self.w.gather(EMBEDDING, ids)
            if a.spec.scaled_embedding:
                x = ops.multiply(x, np.float32(np.sqrt(a.hidden))).output(0)
        else:
            x = self.param("hidden_states", ov.Type.f32, [*flat, a.hidden]).output(0)
            if self.paged:
                x = ops.unsqueeze(x, _i64(0)).output(0)
        if self.paged:
            position_ids = ops.unsqueeze(self.param("position_ids", ov.Type.i64, [-1]), _i64(0)).output(0)
            self.paged_plan = {n: self.param(n, ov.Type.i32, [-1]).output(0) for n in PAGED_INPUTS}
            self.paged_plan["max_context_len"] = self.param("max_context_len", ov.Type.i32, []).output(0)
        else:
            attention_mask = self.param("attention_mask", ov.Type.i64, [-1, -1]).output(0)
            position_ids = self.param("position_ids", ov.Type.i64, [-1, -1]).output(0)
            self.build_masks(attention_mask, position_ids)
        self.position_ids = position_ids
        layer = a.spec.layer
        for i in plan.layers:
            x = layer(self, x, i)
        if plan.has_head:
            # Logits only where a token is chosen: the lm_head (here as costly as ~8 layers per
            # position) runs on the positions `logits_index` names ([B, N], indices into T: the
            # last of a prompt, the K+1 of a verify step, none for a prompt chunk that is not
            # the last), not on every position of a prompt.
            if self.paged:  # [N] positions of the flat batch
                index = self.param("logits_index", ov.Type.i64, [-1]).output(0)
                x = ops.gather(x, index, np.int64(1)).output(0)
            else:
                index = self.param("logits_index", ov.Type.i64, [-1, -1]).output(0)
                x = ops.gather(x, index, np.int64(1), batch_dims=1).output(0)
            head = EMBEDDING if a.tied_embeddings else "lm_head.weight"
            x = self.project(self.rms(x, "model.norm.weight"), self.w.one(head))
            if a.logit_softcap is not None:
                cap = np.float32(a.logit_softcap)
                x = ops.multiply(ops.tanh(ops.divide(x, cap)), cap).output(0)
            self.result(ops.squeeze(x, _i64(0)).output(0) if self.paged else x, "logits")
        else:
            self.result(ops.squeeze(x, _i64(0)).output(0) if self.paged else x, "out_hidden")
        # Outputs first (logits / hidden), then the present KV pairs in layer order.
        self.results.insert(0, self.results.pop())
        return ov.Model(self.results, self.params, plan.name)


def build_stage(arch: Arch, plan: StagePlan, weights: Weights, new_kv_only: bool = False,
                paged: bool = False) -> ov.Model:
    """`paged`: attention over block pools, one flat ragged batch per call (export/paged.py)."""
    return _Builder(arch, plan, weights, new_kv_only, paged).build()


def stage_tensor_names(arch: Arch, plan: StagePlan) -> list[str]:
    """Every source tensor a stage reads (for per-stage loading and the manifest)."""
    names = [n for i in plan.layers for n in arch.layer_tensors(i)]
    if plan.has_embedding or (plan.has_head and arch.tied_embeddings):
        names.append(EMBEDDING)
    if plan.has_head:
        names.append("model.norm.weight")
        if not arch.tied_embeddings:
            names.append("lm_head.weight")
    return names
