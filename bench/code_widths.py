"""Why 5- and 6-bit GGUF codes are stored as 8-bit ones: one compressed matmul per code layout.

OpenVINO's CPU plugin runs compressed matmuls on u2, u4, u8 and i8 codes (group scales and
zero points), and expands u3/u5/u6 codes to f32 at load. A 6-bit code could instead be kept at
its size as two matmuls, a u4 low part and a u2 high part (x @ W = x @ W_lo + x @ W_hi): this
times each layout on a FFN-sized matrix (5632 x 2048, groups of 16), one decode row, f32 and
the plugin's int8 activations, interleaved, medians.

    python bench/code_widths.py [--reps 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset15 as ops

ROWS, COLS, GROUP = 5632, 2048, 16
LAYOUTS = {  # name: planes of (code type, bits per code)
    "u8 (6-bit codes widened)": [("u8", 8)],
    "u4 + u2 (two matmuls)": [("u4", 4), ("u2", 2)],
    "u4 alone (Q4_K's width)": [("u4", 4)],
    "u2 alone (Q2_K's width)": [("u2", 2)],
}


def plane(x: ov.Output, kind: str, bits: int, rng: np.random.Generator) -> ov.Output:
    groups = COLS // GROUP
    codes = rng.integers(0, 2 ** bits, size=ROWS * COLS, dtype=np.uint8)
    per = 8 // bits
    packed = np.zeros(ROWS * COLS // per, dtype=np.uint8)
    for i in range(per):
        packed |= codes[i::per] << np.uint8(bits * i)
    c = ov.op.Constant(ov.Tensor(packed, ov.Shape([ROWS, groups, GROUP]), getattr(ov.Type, kind)), shared_memory=False)
    w = ops.subtract(ops.convert(c, ov.Type.f32), ops.constant(rng.uniform(0, 3, (ROWS, groups, 1)).astype(np.float32)))
    w = ops.multiply(w, ops.constant(rng.uniform(1e-3, 1e-2, (ROWS, groups, 1)).astype(np.float32)))
    w = ops.reshape(w, ops.constant(np.array([ROWS, COLS], dtype=np.int64)), False)
    return ops.matmul(x, w, False, True).output(0)


def compiled(planes: list[tuple[str, int]], precision: dict[str, str]) -> ov.InferRequest:
    rng = np.random.default_rng(0)
    x = ops.parameter(ov.PartialShape([1, -1, COLS]), ov.Type.f32, name="x")
    y = plane(x, *planes[0], rng)
    for kind, bits in planes[1:]:
        y = ops.add(y, plane(x, kind, bits, rng)).output(0)
    model = ov.Model([ops.result(y)], [x])
    return ov.Core().compile_model(model, "CPU", precision | {"INFERENCE_NUM_THREADS": "2"}).create_infer_request()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    precisions = {"exact": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
                  "fast": {"INFERENCE_PRECISION_HINT": "f32"}}
    reqs = {(name, prec): compiled(planes, cfg) for name, planes in LAYOUTS.items() for prec, cfg in precisions.items()}
    x = np.random.default_rng(1).standard_normal((1, 1, COLS)).astype(np.float32)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in reqs}
    for _ in range(args.reps):
        for key, req in reqs.items():
            for _ in range(5):
                req.infer({0: x})
            start = time.perf_counter()
            for _ in range(args.calls):
                req.infer({0: x})
            times[key].append((time.perf_counter() - start) / args.calls * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'layout':<28}{'bits/code':>10}{'exact us':>10}{'fast us':>10}")
    for name, planes in LAYOUTS.items():
        print(f"{name:<28}{sum(b for _, b in planes):>10}{med[(name, 'exact')]:>10.0f}{med[(name, 'fast')]:>10.0f}")
    split, wide = "u4 + u2 (two matmuls)", "u8 (6-bit codes widened)"
    figures = {"split_over_u8_exact": med[(split, "exact")] / med[(wide, "exact")],
               "split_over_u8_fast": med[(split, "fast")] / med[(wide, "fast")],
               "us": {f"{n} {p}": round(v, 1) for (n, p), v in med.items()}, "reps": args.reps, "calls": args.calls}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
