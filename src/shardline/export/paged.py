"""A stage's attention as OpenVINO's PagedAttention (issue 41): the KV of every layer lives in a
pool of blocks that the caller owns and passes in (`key_cache.N`, `value_cache.N`: the device
picks their block size, layout and precision when it compiles), and one call runs a ragged batch:
the new tokens of several sequences end to end, each sequence with its own past.

The graph takes, besides the tokens (or hidden states) and their positions, all flat:
- past_lens [S] i32: tokens each sequence already has in its blocks;
- subsequence_begins [S + 1] i32: where each sequence's new tokens start in the flat batch;
- block_indices [sum of blocks] i32, block_indices_begins [S + 1] i32: each sequence's block
  table, end to end (serving/kv_blocks.py makes them);
- max_context_len [] i32: the longest past + new of the batch.
The op writes the new tokens' KV into the blocks itself, then attends, causally within each
sequence. It is built here rather than by `paged_attention_transformation` over the stateful
graph: that pass reads batch and sequence from shapes our graph derives from its mask (measured:
it compiles, then the first call fails on a key of [T, T * kv]), and a graph we build says what
it means.

Inputs 13-27 of the op in OpenVINO 2026.4 (score aggregation, cache rotation, XAttention, sinks,
adaptive R-KV, q-q bias) are given empty, as the transformation gives them.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

PAGED_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")


def _empty(dtype: type, shape: tuple[int, ...] = (0,)) -> ov.Output:
    return ops.constant(np.zeros(shape, dtype)).output(0)


def _scalar(value: float | int, dtype: type) -> ov.Output:
    return ops.constant(np.array(value, dtype)).output(0)


def _unused() -> list[ov.Output]:
    """The op's inputs 13-27, each as the pass that makes the op leaves it: empty or zero."""
    i32, f32 = np.int32, np.float32
    return [_empty(i32), _empty(i32), _empty(i32), _empty(f32), _empty(f32), _scalar(0, i32), _scalar(0, i32),
            _empty(f32, (0, 0, 0, 0)), _scalar(0, i32), _empty(i32), _empty(i32), _empty(i32), _empty(i32),
            _empty(np.uint8), _empty(i32)]


def flat(x: ov.Output, heads: int, head_dim: int) -> ov.Output:
    """[1, heads, T, D] -> [T, heads * D]: the op's layout."""
    y = ops.transpose(x, ops.constant(np.array([0, 2, 1, 3], np.int64)))
    return ops.reshape(y, ops.constant(np.array([-1, heads * head_dim], np.int64)), False).output(0)


def paged_attention(q: ov.Output, k: ov.Output, v: ov.Output, caches: tuple[ov.Output, ov.Output],
                    plan: dict[str, ov.Output], heads: tuple[int, int, int], scale: float,
                    window: int | None) -> ov.Output:
    """Attention of the batch's new tokens ([1, heads, T, D] each, rotary applied) over their
    sequences' blocks and themselves: [T, heads * D]. `heads`: (query heads, KV heads, D)."""
    n_heads, n_kv, d = heads
    args = [flat(q, n_heads, d), flat(k, n_kv, d), flat(v, n_kv, d), *caches,
            *(plan[n] for n in PAGED_INPUTS), _scalar(scale, np.float32), _scalar(window or 0, np.int32),
            _empty(np.float32), plan["max_context_len"], *_unused()]
    op = _PagedAttentionExtension(args)
    rt = op.get_rt_info()  # what the CPU plugin sizes the blocks by (the pass sets the same)
    rt["num_k_heads"], rt["k_head_size"], rt["num_v_heads"], rt["v_head_size"] = n_kv, d, n_kv, d
    return op.output(0)


# An IR cannot hold the op: OpenVINO 2026.4 reads no PagedAttentionExtension back ("unsupported
# opset: extension"), and GenAI never saves one (it rewrites a stateful IR at load). So a paged
# stage is saved cut at its attention ops: each op's inputs become outputs named CUT.i.j and its
# output a parameter named CUT.i:kv_heads:head_dim, and `joined` puts the ops back after reading.
CUT = "paged_attention"


def cut(model: ov.Model) -> ov.Model:
    """`model` with every PagedAttention op replaced by outputs (its inputs) and a parameter
    (its output): a graph an IR holds. The stage's own outputs and inputs keep their order."""
    ops_ = [n for n in model.get_ordered_ops() if n.get_type_name() == "PagedAttentionExtension"]
    results, params = [], []
    for i, op in enumerate(ops_):
        rt = op.get_rt_info()
        kv, d = int(rt["num_k_heads"].astype(int)), int(rt["k_head_size"].astype(int))
        for j in range(op.get_input_size()):
            r = ops.result(op.input_value(j))
            r.set_friendly_name(f"{CUT}.{i}.{j}")  # a result shares its input's tensor (and names): not renamed
            results.append(r)
        out = op.output(0)
        p = ops.parameter(out.get_partial_shape(), out.get_element_type(), name=f"{CUT}.{i}:{kv}:{d}")
        p.output(0).get_tensor().set_names({f"{CUT}.{i}:{kv}:{d}"})
        for target in list(out.get_target_inputs()):
            target.replace_source_output(p.output(0))
        params.append(p)
    return ov.Model([*model.get_results(), *results], [*model.get_parameters(), *params], model.get_friendly_name())


def joined(model: ov.Model) -> ov.Model:
    """`cut`'s graph with its PagedAttention ops back (what a paged runner compiles)."""
    params = [p for p in model.get_parameters() if p.get_friendly_name().startswith(CUT + ".")]
    cuts = {r.get_friendly_name(): r for r in model.get_results() if r.get_friendly_name().startswith(CUT + ".")}
    if not params:
        raise ValueError("not a cut paged graph: it has no attention cut out")
    for p in params:
        name, kv, d = p.get_friendly_name().split(":")
        i = name.split(".")[1]
        n = sum(1 for k in cuts if k.startswith(f"{CUT}.{i}."))
        args = [cuts[f"{CUT}.{i}.{j}"].input_value(0) for j in range(n)]
        op = _PagedAttentionExtension(args)
        rt = op.get_rt_info()
        rt["num_k_heads"], rt["k_head_size"], rt["num_v_heads"], rt["v_head_size"] = int(kv), int(d), int(kv), int(d)
        for target in list(p.output(0).get_target_inputs()):
            target.replace_source_output(op.output(0))
    kept = [r for r in model.get_results() if r.get_friendly_name() not in cuts]
    others = [p for p in model.get_parameters() if not p.get_friendly_name().startswith(CUT + ".")]
    return ov.Model(kept, others, model.get_friendly_name())
