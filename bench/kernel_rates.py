"""What layout of compressed weights the CPU plugin streams fastest (issue 22: "do the u4 group-32
matmuls of a Q4_0/Q4_K file take the plugin's compressed-weight kernel, and what layout would?").

One model per layout: a chain of `--mats` matmuls of 12288 x 4096 weights each (~400 MB of u4
codes in all, far past any cache: what a decode step streams), each weight the plugin's
decompression pattern Convert(codes) [- zero point] * scale, as the export writes it. Timed in
the two precisions shardline runs: `exact` (f32 activations) and `fast` (the plugin's dynamic
int8 quantization of activations, DYNAMIC_QUANTIZATION_GROUP_SIZE equal to the weight group),
at 1, 5 and 8 rows (a decode step, a 4-draft verify step, a group of 8 streams).

Layouts (the first four are what a GGUF file's blocks become under `--weights gguf`):
- Q4_0: u4 codes, the integer zero point 8, f16 scales, groups of 32;
- Q4_K exact: u4 codes, an f32 zero point and f32 scale per group of 32 (the mins folded in);
- Q4_K fast: u4 codes and f32 scales, the mins apart as a small f32 matmul (stage/zero_points.py);
- Q6_K: u8 codes (6-bit ones widened), the integer zero point 32, f32 scales per 16;
- re-blocked u4 with u4 zero points and f16 scales in groups of 64, 128 and 256, and per channel:
  what a file re-quantized to larger groups would take.

    python bench/kernel_rates.py [--mats 8] [--reps 9]     # about 3 minutes
    python bench/kernel_rates.py --quick

The last line is one JSON object: per layout and precision, G weights/s at one row first, then
the 5- and 8-row steps over the one-row step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset15 as ops

ROWS, COLS = 12288, 4096
STEPS = (1, 5, 8)


@dataclass(frozen=True)
class Layout:
    bits: int  # 4: u4 codes, 8: u8
    group: int
    zero: str  # "none", "int" (one integer for all), "u4" (per group), "f32" (per group)
    scale: str  # "f16" or "f32"
    mins_apart: bool = False  # Q4_K fast: a second, f32 matmul over the inputs' group sums

    def bytes_per_weight(self) -> float:
        per_group = {"f16": 2, "f32": 4}[self.scale] + {"none": 0, "int": 0, "u4": 0.5, "f32": 4}[self.zero]
        return self.bits / 8 + per_group / self.group + (4 / self.group if self.mins_apart else 0)


LAYOUTS = {
    "Q4_0 (u4, zp 8, f16 s, g32)": Layout(4, 32, "int", "f16"),
    "Q4_K exact (u4, f32 zp+s, g32)": Layout(4, 32, "f32", "f32"),
    "Q4_K fast (u4, f32 s, mins apart)": Layout(4, 32, "none", "f32", mins_apart=True),
    "Q6_K (u8, zp 32, f32 s, g16)": Layout(8, 16, "int", "f32"),
    "u4, u4 zp, f16 s, g64": Layout(4, 64, "u4", "f16"),
    "u4, u4 zp, f16 s, g128": Layout(4, 128, "u4", "f16"),
    "u4, u4 zp, f16 s, g256": Layout(4, 256, "u4", "f16"),
    "u4, u4 zp, f16 s, per channel": Layout(4, COLS, "u4", "f16"),
}


def _i64(*v: int) -> ov.Node:
    return ops.constant(np.array(v, dtype=np.int64))


def _packed(codes: np.ndarray, bits: int, shape: list[int]) -> ov.Node:
    flat = codes.reshape(-1).astype(np.uint8)
    data = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8) if bits == 4 else flat
    kind = ov.Type.u4 if bits == 4 else ov.Type.u8
    return ov.op.Constant(ov.Tensor(data, ov.Shape(shape), kind), shared_memory=False)


def _matmul(x: ov.Output, lay: Layout, rng: np.random.Generator) -> ov.Output:
    groups, top = COLS // lay.group, 2 ** lay.bits
    w = ops.convert(_packed(rng.integers(0, top, ROWS * COLS), lay.bits, [ROWS, groups, lay.group]), ov.Type.f32)
    if lay.zero == "int":
        w = ops.subtract(w, ops.convert(ops.constant(np.full((1, 1, 1), top // 2, np.uint8)), ov.Type.f32))
    elif lay.zero == "u4":
        w = ops.subtract(w, ops.convert(_packed(rng.integers(0, 16, ROWS * groups), 4, [ROWS, groups, 1]), ov.Type.f32))
    elif lay.zero == "f32":
        w = ops.subtract(w, ops.constant(rng.uniform(0, top - 1, (ROWS, groups, 1)).astype(np.float32)))
    s = rng.uniform(1e-3, 1e-2, (ROWS, groups, 1))
    scale = ops.convert(ops.constant(s.astype(np.float16)), ov.Type.f32) if lay.scale == "f16" else ops.constant(
        s.astype(np.float32))
    y = ops.matmul(x, ops.reshape(ops.multiply(w, scale), _i64(ROWS, COLS), False), False, True)
    if lay.mins_apart:
        sums = ops.reduce_sum(ops.reshape(x, _i64(0, 0, -1, lay.group), True), _i64(-1), False)
        y = ops.add(y, ops.matmul(sums, ops.constant(rng.uniform(-1, 1, (ROWS, groups)).astype(np.float32)), False,
                                  True))
    # back to COLS wide for the next matmul (ROWS = 3 x COLS), scaled to keep values in range
    y = ops.reduce_sum(ops.reshape(y, _i64(0, 0, ROWS // COLS, COLS), True), _i64(2), False)
    return ops.multiply(y, ops.constant(np.float32(0.01))).output(0)


def compiled(lay: Layout, mats: int, precision: str) -> ov.InferRequest:
    rng = np.random.default_rng(0)
    x0 = ops.parameter(ov.PartialShape([1, -1, COLS]), ov.Type.f32)
    x = x0.output(0)
    for _ in range(mats):
        x = _matmul(x, lay, rng)
    dq = "0" if precision == "exact" else str(min(lay.group, COLS))
    props = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "2", "DYNAMIC_QUANTIZATION_GROUP_SIZE": dq}
    return ov.Core().compile_model(ov.Model([ops.result(x)], [x0]), "CPU", props).create_infer_request()


def timed(req: ov.InferRequest, rows: int, reps: int) -> float:
    x = np.random.default_rng(1).standard_normal((1, rows, COLS)).astype(np.float32)
    for _ in range(2):
        req.infer({0: x})
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        req.infer({0: x})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mats", type=int, default=8)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="2 matmuls, 3 reps, three layouts")
    args = p.parse_args()
    layouts = dict(list(LAYOUTS.items())[:3]) if args.quick else LAYOUTS
    if args.quick:
        args.mats, args.reps = 2, 3
    weights = args.mats * ROWS * COLS
    print(f"{args.mats} matmuls of {ROWS}x{COLS}, 2 threads, medians of {args.reps}")
    print(f"{'layout':<36}{'B/weight':>9}{'precision':>10}{'ms 1 row':>10}{'Gw/s':>7}{'GB/s':>7}{'5 rows':>8}"
          f"{'8 rows':>8}")
    figures: dict[str, dict[str, float]] = {}
    for name, lay in layouts.items():
        for precision in ("exact", "fast"):
            req = compiled(lay, args.mats, precision)
            t = {rows: timed(req, rows, args.reps) for rows in STEPS}
            del req
            rate = weights / t[1] / 1e9
            print(f"{name:<36}{lay.bytes_per_weight():>9.3f}{precision:>10}{1e3 * t[1]:>10.1f}{rate:>7.1f}"
                  f"{rate * lay.bytes_per_weight():>7.1f}{t[5] / t[1]:>8.2f}{t[8] / t[1]:>8.2f}", flush=True)
            figures[f"{name} {precision}"] = {"gw_s": round(rate, 2), "rows5_over_1": round(t[5] / t[1], 3),
                                              "rows8_over_1": round(t[8] / t[1], 3),
                                              "bytes_per_weight": round(lay.bytes_per_weight(), 4)}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
