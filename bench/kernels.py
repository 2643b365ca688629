"""shardline's block op against the CPU plugin's compressed matmul on the same GGUF blocks, per
type and row count: G weights/s (weights streamed per second, a row of x at a time counted once
per call), 2 threads, in one run on one machine.

Each type's graph holds 8 matrices of [4096, 2048] (67 M weights, more than the caches) that all
take the same x [M, 2048]. The op's graph is the export's form (kernels/ops.py, through an IR);
the plugin's is that graph after stage/block_ops.plugin_form, compiled as `fast` compiles it
(f32 compute; int8 activations only where the CPU has VNNI). Where the two cross as M grows is
where a prompt chunk would rather take the plugin's GEMM.

    python bench/kernels.py                          # every type, M = 1, 4, 16, 64, 256
    python bench/kernels.py --types Q4_K,Q6_K --rows 1,128

The last line is one JSON object: per type and M, op / plugin ratios first, then the rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.ggufs: the random blocks

import openvino as ov  # noqa: E402
import openvino.opset15 as ops  # noqa: E402

from shardline.config import RunConfig  # noqa: E402
from shardline.kernels.load import attach, isa  # noqa: E402
from shardline.kernels.ops import BLOCKS, block_matmul  # noqa: E402
from shardline.stage.block_ops import plugin_form  # noqa: E402
from tests.ggufs import raw_blocks  # noqa: E402

MATRICES, ROWS, COLS = 8, 4096, 2048


def graph(kind: str, folder: Path) -> Path:
    x = ops.parameter([-1, COLS], ov.Type.f32, name="x")
    outs = [block_matmul(x.output(0), ops.constant(raw_blocks(kind, ROWS, COLS, f"bench-{kind}-{i}")).output(0),
                         kind, COLS, f"w{i}") for i in range(MATRICES)]
    path = folder / f"{kind}.xml"
    ov.save_model(ov.Model(outs, [x]), path)
    return path


def rate(compiled: ov.CompiledModel, m: int, reps: int) -> float:
    request = compiled.create_infer_request()
    x = np.random.default_rng(0).standard_normal((m, COLS)).astype(np.float32)
    request.infer({"x": x})
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        request.infer({"x": x})
        times.append(time.perf_counter() - t)
    return MATRICES * ROWS * COLS * m / statistics.median(times) / 1e9


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{model} ({', '.join(f for f in ('avx2', 'avx_vnni', 'avx512_vnni', 'amx_int8') if f in flags)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(BLOCKS))
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    core = ov.Core()
    if not attach(core):
        print("the kernels are not built: python -m shardline.kernels.build", file=sys.stderr)
        return 1
    props = RunConfig(precision="fast", threads=args.threads).ov_properties()
    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, dict[str, float]] = {}
    print(f"CPU: {cpu()}; kernels at {isa()}; {args.threads} threads; G weights/s (median of {args.reps})")
    print(f"{'type':6} {'M':>4} {'op':>8} {'plugin':>8} {'op/plugin':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.types.split(","):
            path = graph(kind, Path(tmp))
            op = core.compile_model(core.read_model(path), "CPU", props)
            model = core.read_model(path)
            plugin_form(model)
            plugin = core.compile_model(model, "CPU", props)
            for m in rows:
                a, b = rate(op, m, args.reps), rate(plugin, m, max(3, args.reps // 2 if m > 16 else args.reps))
                out[f"{kind}@{m}"] = {"ratio": round(a / b, 3), "op": round(a, 2), "plugin": round(b, 2)}
                print(f"{kind:6} {m:>4} {a:8.2f} {b:8.2f} {a / b:9.2f}x")
            del op, plugin, model
    print(json.dumps({"ratios": {k: v["ratio"] for k, v in out.items()}, "rates": out, "cpu": cpu(),
                      "threads": args.threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
