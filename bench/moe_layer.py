"""A mixture-of-experts FFN against a dense FFN with the same active weights, on the CPU plugin
(issue 38, point 6: "a layer's decode cost within 1.5x of a dense layer with the same active
bytes"). Both in the layout `--weights gguf` gives a Q4_K file's matrices: u4 codes with an f32
scale and f32 zero point per 32 weights.

- MoE: Qwen3-30B-A3B's FFN, 128 experts of 768 rows over hidden 2048, 8 chosen per token by a
  softmax router, in the tiled form the plugin runs as three GatherMatmul nodes (export/graph.py).
- Dense: a SwiGLU FFN of 8 x 768 = 6144 rows: the same 37.7 M weights a token reads.

`--blocks` of each are chained, each with its own weights, so a step streams them from memory
as a model's decode step does (4 blocks: 113 MB of active weights a step). Timed at 1, 4 and 8
rows (a decode step, and decode groups of 4 and 8 streams: rows choose different experts, so a
group reads more of them), in `exact` (no dynamic quantization) and `fast` (int8 activations
where the CPU has the kernels). Medians of alternating reps, 2 threads.

    python bench/moe_layer.py                 # about 2 minutes
    python bench/moe_layer.py --blocks 2 --reps 5

The last line is one JSON object, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset15 as ops

EXPERTS, USED, HIDDEN, EXPERT_FFN = 128, 8, 2048, 768
GROUP = 32
ROWS = (1, 4, 8)


def _i64(*v: int) -> ov.Node:
    return ops.constant(np.array(v, dtype=np.int64))


def _q4k(lead: tuple[int, ...], rows: int, cols: int, rng: np.random.Generator) -> ov.Output:
    """Convert(u4 codes) - f32 zero point, * f32 scale, per GROUP: [*lead, rows, cols]."""
    groups = cols // GROUP
    shape = [*lead, rows, groups, GROUP]
    packed = rng.integers(0, 256, int(np.prod(shape)) // 2, dtype=np.uint8)
    codes = ov.op.Constant(ov.Tensor(packed, ov.Shape(shape), ov.Type.u4), shared_memory=False)
    side = (*lead, rows, groups, 1)
    w = ops.subtract(ops.convert(codes, ov.Type.f32), ops.constant(rng.uniform(0, 15, side).astype(np.float32)))
    w = ops.multiply(w, ops.constant(rng.uniform(1e-3, 1e-2, side).astype(np.float32)))
    return ops.reshape(w, _i64(*lead, rows, cols), False).output(0)


def _moe(x: ov.Output, rng: np.random.Generator) -> ov.Output:
    router = ops.constant((rng.standard_normal((EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32))
    probs = ops.softmax(ops.matmul(x, router, False, True), 1)
    top = ops.topk(probs, np.int64(USED), 1, "max", "value", ov.Type.i64, stable=True)
    chosen = ops.divide(top.output(0), ops.reduce_sum(top.output(0), _i64(1), True))
    weights = ops.scatter_elements_update(ops.broadcast(np.float32(0), ops.shape_of(probs)), top.output(1), chosen,
                                          np.int64(1))
    routed = ops.reshape(ops.transpose(weights, _i64(1, 0)), _i64(EXPERTS, -1, 1), False)
    tiled = ops.reshape(ops.tile(x, _i64(EXPERTS, 1)), _i64(EXPERTS, -1, HIDDEN), False)
    gate = ops.matmul(tiled, _q4k((EXPERTS,), EXPERT_FFN, HIDDEN, rng), False, True)
    up = ops.matmul(tiled, _q4k((EXPERTS,), EXPERT_FFN, HIDDEN, rng), False, True)
    act = ops.multiply(ops.multiply(gate, ops.sigmoid(gate)), up)
    down = ops.matmul(act, _q4k((EXPERTS,), HIDDEN, EXPERT_FFN, rng), False, True)
    out = ops.reduce_sum(ops.multiply(ops.reshape(down, _i64(EXPERTS, -1, HIDDEN), False), routed), _i64(0), False)
    return ops.add(x, out).output(0)


def _dense(x: ov.Output, rng: np.random.Generator) -> ov.Output:
    ffn = USED * EXPERT_FFN
    gate = ops.matmul(x, _q4k((), ffn, HIDDEN, rng), False, True)
    up = ops.matmul(x, _q4k((), ffn, HIDDEN, rng), False, True)
    act = ops.multiply(ops.multiply(gate, ops.sigmoid(gate)), up)
    return ops.add(x, ops.matmul(act, _q4k((), HIDDEN, ffn, rng), False, True)).output(0)


def compiled(kind: str, blocks: int, precision: str) -> ov.InferRequest:
    rng = np.random.default_rng(0)
    x0 = ops.parameter(ov.PartialShape([-1, HIDDEN]), ov.Type.f32)
    x = x0.output(0)
    for _ in range(blocks):
        x = (_moe if kind == "moe" else _dense)(x, rng)
    props = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "2",
             "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0" if precision == "exact" else str(GROUP)}
    model = ov.Model([ops.result(x)], [x0])
    req = ov.Core().compile_model(model, "CPU", props).create_infer_request()
    if kind == "moe":
        kinds = [op.get_rt_info()["layerType"].astype(str) for op in req.get_compiled_model().get_runtime_model()
                 .get_ops()]
        assert kinds.count("GatherMatmul") == 3 * blocks, "the experts did not fuse into GatherMatmul"
    return req


def timed(req: ov.InferRequest, rows: int) -> float:
    x = np.random.default_rng(rows).standard_normal((rows, HIDDEN)).astype(np.float32)
    req.infer({0: x})
    start = time.perf_counter()
    req.infer({0: x})
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    active = 3 * USED * EXPERT_FFN * HIDDEN * 0.75  # bytes per block a token reads (0.75 B/weight)
    print(f"{args.blocks} FFN blocks, {active / 1e6:.1f} MB of active weights each, 2 threads, medians of "
          f"{args.reps}")
    print(f"{'precision':<10}{'rows':>5}{'MoE ms/block':>14}{'dense ms/block':>16}{'MoE / dense':>13}"
          f"{'MoE GB/s':>10}{'dense GB/s':>12}")
    figures: dict[str, float] = {}
    for precision in ("exact", "fast"):
        reqs = {kind: compiled(kind, args.blocks, precision) for kind in ("moe", "dense")}
        for rows in ROWS:
            times: dict[str, list[float]] = {"moe": [], "dense": []}
            for _ in range(args.reps):
                for kind, req in reqs.items():
                    times[kind].append(timed(req, rows) / args.blocks * 1e3)
            moe, dense = statistics.median(times["moe"]), statistics.median(times["dense"])
            figures[f"moe_over_dense_{precision}_{rows}"] = round(moe / dense, 3)
            figures[f"moe_ms_{precision}_{rows}"] = round(moe, 3)
            figures[f"dense_ms_{precision}_{rows}"] = round(dense, 3)
            print(f"{precision:<10}{rows:>5}{moe:>14.2f}{dense:>16.2f}{moe / dense:>13.2f}"
                  f"{active / moe / 1e6:>10.1f}{active / dense / 1e6:>12.1f}")
        del reqs
    ratios = {k: v for k, v in figures.items() if k.startswith("moe_over")}
    print(json.dumps(ratios | {k: v for k, v in figures.items() if k not in ratios} |
                     {"blocks": args.blocks, "reps": args.reps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
