"""What of an OpenVINO graph is not static: a static export (export/static.py) must have none,
and a static runner (stage/static_runner.py) refuses a graph its manifest calls static that has
any. Weight compression may bring a dynamic dimension back (a decompression subgraph that
reshapes by a computed shape, say): the exporter checks after it."""

from __future__ import annotations

import openvino as ov


def dynamic(model: ov.Model) -> list[str]:
    """The inputs, outputs and operations of `model` whose shape is not static ([] when none)."""
    ports = [f"input {p.get_any_name()}" for p in model.inputs if not p.get_partial_shape().is_static]
    ports += [f"output {p.get_any_name()}" for p in model.outputs if not p.get_partial_shape().is_static]
    for op in model.get_ordered_ops():
        if any(not out.get_partial_shape().is_static for out in op.outputs()):
            ports.append(f"{op.get_type_name()} {op.get_friendly_name()}")
    return ports
