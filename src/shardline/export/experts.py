"""A mixture of experts' graph, for export/graph.py's LayerOps.moe and moe_oai.

Both are in the "tiled" form (every expert's matmul over every token, weighted by a [experts,
tokens] matrix that is zero but for each token's chosen experts). For Qwen3-MoE and Mixtral it is
exactly the pattern OpenVINO's CPU plugin turns into GatherMatmul nodes that compute only the
chosen experts (docs/research/moe-openvino.md, its 3-GEMM pattern). gpt-oss's experts (biases, a
clamped SwiGLU) take its 2-GEMM pattern: one matmul over the gate and up rows alternated, then
down, each bias gathered with its expert.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from shardline.export.weights import Linear, Weights
from shardline.model.arch import Arch

# gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai: alpha 1.702, limit 7).
OAI_ALPHA, OAI_LIMIT = np.float32(1.702), np.float32(7.0)


class _Graph(Protocol):
    a: Arch
    w: Weights

    def project(self, x: ov.Output, lin: Linear) -> ov.Output: ...


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def _routed(weights: ov.Output, top: ov.Node, chosen: ov.Output, a: Arch) -> ov.Output:
    """[E, T, 1]: each token's chosen weights in its experts' rows, 0 elsewhere."""
    zeros = ops.broadcast(np.float32(0.0), ops.shape_of(weights))
    dense = ops.scatter_elements_update(zeros, top.output(1), chosen, np.int64(1))  # [T, E]
    # The matcher wants these Reshapes (and each node here used once): no-ops otherwise.
    return ops.reshape(ops.transpose(dense, _i64(1, 0)), _i64(a.experts, -1, 1), False).output(0)


def _top(scores: ov.Output, a: Arch) -> ov.Node:
    # Ties go to the lower expert, as llama.cpp's argsort (std::sort, an insertion sort, so
    # stable, over at most 16 experts) breaks them; beyond 16 its introsort has no fixed order.
    return ops.topk(scores, np.int64(a.experts_used), 1, "max", "value", ov.Type.i64, stable=True)


def _tiled(tokens: ov.Output, a: Arch) -> ov.Output:
    return ops.reshape(ops.tile(tokens, _i64(a.experts, 1)), _i64(a.experts, -1, a.hidden), False).output(0)


def routed_experts(g: _Graph, x: ov.Output, prefix: str) -> ov.Output:
    """Softmax router, the top experts_used renormalised to sum to 1 (llama.cpp's build_moe_ffn
    with norm_w), SwiGLU experts: the GatherMatmul pattern."""
    a, w = g.a, g.w
    tokens = ops.reshape(x, _i64(-1, a.hidden), False).output(0)  # [T, H]
    probs = ops.softmax(g.project(tokens, w.one(prefix + "gate.weight")), 1).output(0)  # [T, E]
    top = _top(probs, a)
    chosen = ops.divide(top.output(0), ops.reduce_sum(top.output(0), _i64(1), True)).output(0)
    routed = _routed(probs, top, chosen, a)
    tiled = _tiled(tokens, a)
    gate = ops.matmul(tiled, w.experts(prefix + "experts.gate_proj.weight", a.experts), False, True)
    up = ops.matmul(tiled, w.experts(prefix + "experts.up_proj.weight", a.experts), False, True)
    act = ops.multiply(ops.multiply(gate, ops.sigmoid(gate)), up)  # x * sigmoid(x): the one-input Swish fused
    down = ops.matmul(act, w.experts(prefix + "experts.down_proj.weight", a.experts), False, True)
    down = ops.reshape(down, _i64(a.experts, -1, a.hidden), False)  # [E, T, H]
    out = ops.reduce_sum(ops.multiply(down, routed), _i64(0), False)  # [T, H]
    return ops.reshape(out, ops.shape_of(x), False).output(0)


def oai_experts(g: _Graph, x: ov.Output, prefix: str) -> ov.Output:
    """gpt-oss (llama.cpp's SOFTMAX_WEIGHT gating and SWIGLU_OAI_MOE): the router with its bias,
    the top experts_used by logit, a softmax over those; experts with biases, the gate clamped
    above at 7 and the up at +-7, gate * sigmoid(1.702 gate) * (up + 1). Written as the plugin's
    2-GEMM pattern (optimum-intel's gpt-oss form): one gate-up matmul over the experts' rows
    alternated, its bias a constant [E, 1, 2F], strided slices apart, Swish with its beta; the
    plugin runs both matmuls as GatherMatmul over the chosen experts alone, biases gathered."""
    a, w = g.a, g.w
    tokens = ops.reshape(x, _i64(-1, a.hidden), False).output(0)  # a Reshape: the matcher wants one
    logits = ops.add(g.project(tokens, w.one(prefix + "gate.weight")), w.vector(prefix + "gate.bias")).output(0)
    top = _top(logits, a)
    routed = _routed(logits, top, ops.softmax(top.output(0), 1).output(0), a)
    experts = f"{prefix}experts."
    gate_up = ops.matmul(_tiled(tokens, a), w.experts_interleaved(experts + "gate_proj.weight",
                                                                   experts + "up_proj.weight", a.experts), False, True)
    gate_up = ops.add(gate_up, _bias(w, experts, ("gate_proj", "up_proj")))
    gate = ops.slice(gate_up, _i64(0), _i64(2 * a.expert_ffn), _i64(2), _i64(2))
    up = ops.slice(gate_up, _i64(1), _i64(2 * a.expert_ffn), _i64(2), _i64(2))
    up = ops.add(ops.clamp(up, -float(OAI_LIMIT), float(OAI_LIMIT)), np.float32(1.0))
    glu = ops.swish(ops.minimum(gate, OAI_LIMIT), OAI_ALPHA)  # x * sigmoid(1.702 x)
    down = ops.matmul(ops.multiply(up, glu), w.experts(experts + "down_proj.weight", a.experts), False, True)
    down = ops.reshape(ops.add(down, _bias(w, experts, ("down_proj",))), _i64(a.experts, -1, a.hidden), False)
    out = ops.reduce_sum(ops.multiply(down, routed), _i64(0), False)
    return ops.reshape(out, ops.shape_of(x), False).output(0)


def _bias(w: Weights, prefix: str, names: tuple[str, ...]) -> ov.Node:
    """The experts' biases [E, rows] (two: rows alternated, as the weights) as a constant
    [E, 1, rows * len(names)]: the pattern gathers only a constant."""
    parts = [np.asarray(w.source.tensor(f"{prefix}{n}.bias"), dtype=np.float32) for n in names]
    joined = np.stack(parts, axis=2).reshape(parts[0].shape[0], 1, -1)
    return ops.constant(np.ascontiguousarray(joined))
