"""Make a stateless stage graph stateful: the KV cache lives inside the graph.

Each past/present pair becomes a ReadValue/Assign pair on one variable, and every ReadValue
output goes through Gather(beam_idx, axis 0). The Gather changes no value (it is fed [0] for
one sequence) but it is the pattern OpenVINO's CPU plugin matches to fuse attention with the
KV cache (ScaledDotProductAttentionWithKVCache): without it decode is measurably slower.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset6 as ops6
import openvino.opset15 as ops
from openvino.op.util import Variable, VariableInfo


def make_stateful(model: ov.Model, beam_gather: bool = True) -> ov.Model:
    params = {p.get_friendly_name(): p for p in model.get_parameters()}
    results = {r.get_friendly_name(): r for r in model.get_results()}
    first = model.get_parameters()[0]  # input_ids or hidden_states: gives the batch size
    batch = ops.gather(ops.shape_of(first), np.array([0], dtype=np.int64), np.int64(0))
    beam_idx = None
    if beam_gather:
        beam_idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
        beam_idx.output(0).set_names({"beam_idx"})
    sinks = []
    for name in [n for n in params if n.startswith("past.")]:
        past, present = params[name], results["present." + name[len("past."):]]
        shape = past.get_output_partial_shape(0)
        info = VariableInfo()
        info.data_shape, info.data_type, info.variable_id = shape, ov.Type.f32, name
        var = Variable(info)
        # Initial state: [B, kv_heads, 0, head_dim] zeros, so the first step sees an empty cache.
        dims = ops.concat([batch, np.array([shape[1].get_length(), 0, shape[3].get_length()], np.int64)], 0)
        init = ops.broadcast(np.float32(0), dims)
        state = ops6.read_value(init, var).output(0)
        if beam_idx is not None:
            state = ops.gather(state, beam_idx, np.int64(0)).output(0)
        past.output(0).replace(state)
        sinks.append(ops6.assign(present.input_value(0).get_node(), var))  # a concat: one output
        model.remove_result(present)
        model.remove_parameter(past)
    model.add_sinks(sinks)
    if beam_idx is not None:
        model.add_parameters([beam_idx])
    model.validate_nodes_and_infer_types()
    return model
