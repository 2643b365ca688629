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
adaptive R-KV, q-q bias) are given empty, as the transformation gives them, but for the sinks
of a model that has them (gpt-oss): input 20, one logit per query head as [1, heads, 1, 1], which
the op's softmax takes beside the scores and gives no value, as the stateful graph's
`sink_attention` does.
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


def _unused(sinks: ov.Output | None) -> list[ov.Output]:
    """The op's inputs 13-27, each as the pass that makes the op leaves it (empty or zero), but
    the sinks (input 20) where the layer has them."""
    i32, f32 = np.int32, np.float32
    return [_empty(i32), _empty(i32), _empty(i32), _empty(f32), _empty(f32), _scalar(0, i32), _scalar(0, i32),
            _empty(f32, (0, 0, 0, 0)) if sinks is None else sinks, _scalar(0, i32), _empty(i32), _empty(i32),
            _empty(i32), _empty(i32), _empty(np.uint8), _empty(i32)]


def flat(x: ov.Output, heads: int, head_dim: int) -> ov.Output:
    """[1, heads, T, D] -> [T, heads * D]: the op's layout."""
    y = ops.transpose(x, ops.constant(np.array([0, 2, 1, 3], np.int64)))
    return ops.reshape(y, ops.constant(np.array([-1, heads * head_dim], np.int64)), False).output(0)


def paged_attention(q: ov.Output, k: ov.Output, v: ov.Output, caches: tuple[ov.Output, ov.Output],
                    plan: dict[str, ov.Output], heads: tuple[int, int, int], scale: float,
                    window: int | None, sinks: ov.Output | None = None) -> ov.Output:
    """Attention of the batch's new tokens ([1, heads, T, D] each, rotary applied) over their
    sequences' blocks and themselves: [T, heads * D]. `heads`: (query heads, KV heads, D);
    `sinks`: the layer's sink logits, [1, heads, 1, 1] f32 (None: none)."""
    n_heads, n_kv, d = heads
    args = [flat(q, n_heads, d), flat(k, n_kv, d), flat(v, n_kv, d), *caches,
            *(plan[n] for n in PAGED_INPUTS), _scalar(scale, np.float32), _scalar(window or 0, np.int32),
            _empty(np.float32), plan["max_context_len"], *_unused(sinks)]
    op = _PagedAttentionExtension(args)
    rt = op.get_rt_info()  # what the CPU plugin sizes the blocks by (the pass sets the same)
    rt["num_k_heads"], rt["k_head_size"], rt["num_v_heads"], rt["v_head_size"] = n_kv, d, n_kv, d
    return op.output(0)

