"""A paged stage's graph as an IR holds it (issue 41). OpenVINO 2026.4 reads no
PagedAttentionExtension back from an IR ("unsupported opset: extension"), and GenAI never saves
one (it rewrites a stateful IR at load). So export saves a paged stage cut at its attention ops:
each op's inputs become outputs named CUT.i.j and its output a parameter named
CUT.i:kv_heads:head_dim; the runner joins the ops back after reading (`joined`).
"""

from __future__ import annotations

import openvino as ov
from openvino import opset13 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

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
