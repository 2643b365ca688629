"""Make a stateless stage graph static: every shape fixed, the KV cache on the host.

Devices such as Intel NPUs compile no dynamic shape and no in-graph state. A static stage takes
one row (batch 1) of `width` new tokens (1: the decode graph; C: the prefill graph), and its
past KV as inputs of a fixed `ring` slots, [1, kv_heads, ring, head_dim] per layer; the mask
covers the ring and the new tokens, [1, ring + width]; only the new tokens' KV comes out,
[1, kv_heads, width, head_dim] (graph.py `new_kv_only`). The host runner (stage/static_runner.py)
keeps the ring and writes each step's new KV into it.

Weight compression may bring back a dynamic dimension: the exporter checks the compressed
graph (model/shapes.py `dynamic`) and refuses one that has any.
"""

from __future__ import annotations

import openvino as ov

from shardline.model.arch import Arch


def make_static(model: ov.Model, arch: Arch, ring: int, width: int) -> ov.Model:
    """`model` (built with new_kv_only) with every input shape fixed."""
    kv = [1, arch.n_kv_heads, ring, arch.head_dim]
    fixed = {"input_ids": [1, width], "hidden_states": [1, width, arch.hidden], "position_ids": [1, width],
             "attention_mask": [1, ring + width], "logits_index": [1, 1]}
    shapes = {}
    for p in model.get_parameters():
        name = p.get_friendly_name()
        shapes[p.output(0)] = ov.PartialShape(kv if name.startswith("past.") else fixed[name])
    model.reshape(shapes)
    return model
