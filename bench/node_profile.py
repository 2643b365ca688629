"""Where a decode step's time goes: OpenVINO's per-node counters for our graph and for the graph
openvino_genai builds from the same GGUF, side by side (issue 12).

Both graphs are compiled in this process with the same properties (`--precision`: exact or fast,
as shardline sets them, and for fast with its Q4_1 rewrite, stage/zero_points.py) and PERF_COUNT
on; each gets the same 46-token prompt, then `--steps` decode steps, whose counters (after
`--warmup` steps) are summed per executed node. Reported per step:

- by kernel: the node type the CPU plugin ran (after its fusions) and its implementation
  (brgemm/jit kernels, or `ref` for a reference one), time and count;
- fusions: whether attention ran with its KV cache inside (ScaledDotProductAttentionWithKVCache),
  RoPE, RMS norm and the compressed-weight matmuls (FullyConnectedCompressed) as single nodes,
  and how much time went to reference kernels and to elementwise nodes left over;
- by layer: the executed nodes split at every second RMS node (each decoder layer has two), so
  one row per layer plus the embedding before the first and the final norm and head after.

openvino_genai's graph is the one it writes next to the GGUF when asked
(`enable_save_ov_model`): the bench copies the default model's GGUF under --work and lets
openvino_genai build and save its graph there once.

    python bench/node_profile.py                       # exact and fast, the default model, gguf weights
    python bench/node_profile.py --precision fast --weights int8
    python bench/node_profile.py --shards DIR --gguf FILE   # a 1-stage export of FILE against genai's graph of it

Counters add a little time to every node; compare the two graphs with each other, and speed with
bench/parity.py. The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
from kit import shard_folder, wait_quiet  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig
from shardline.model.source import default_model_path
from shardline.stage.zero_points import split_zero_points

PROMPT = 46  # tokens, as bench/parity.py's chat prompt
FUSED = {  # what each fusion looks like once compiled: the node type the plugin runs
    "attention with its KV cache": "ScaledDotProductAttentionWithKVCache",
    "RoPE": "RoPE",
    "RMS norm": "RMS",
    "compressed-weight matmuls": "FullyConnectedCompressed",
}
LEFTOVER = ("Eltwise", "Add", "Multiply", "Subtract", "Divide", "Power", "Sqrt", "Concat", "Split",
            "VariadicSplit", "StridedSlice", "Slice", "Gather", "Broadcast", "Softmax", "MatMul")


@dataclass
class Profile:
    name: str
    steps: int = 0
    kernel_us: Counter[tuple[str, str]] = field(default_factory=Counter)
    kernel_n: Counter[tuple[str, str]] = field(default_factory=Counter)
    layer_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, infos: list[Any]) -> None:
        self.steps += 1
        rms, segment, layers = 0, "embedding", self._layers(infos)
        for p in infos:
            if p.status != ov.ProfilingInfo.Status.EXECUTED:
                continue
            if p.node_type == "RMS":
                segment = f"layer {rms // 2}" if rms < 2 * layers else "norm + head"
                rms += 1
            us = p.real_time.total_seconds() * 1e6
            self.kernel_us[(p.node_type, p.exec_type)] += us
            self.kernel_n[(p.node_type, p.exec_type)] += 1
            self.layer_us[segment] += us

    @staticmethod
    def _layers(infos: list[Any]) -> int:
        return sum(1 for p in infos if p.node_type.startswith("ScaledDotProductAttention"))

    def per_step(self) -> float:
        return sum(self.kernel_us.values()) / self.steps

    def by_type(self) -> dict[str, tuple[float, int]]:
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for (t, _), us in self.kernel_us.items():
            out[t][0] += us / self.steps
        for (t, _), n in self.kernel_n.items():
            out[t][1] += n // self.steps
        return {t: (v[0], int(v[1])) for t, v in sorted(out.items(), key=lambda kv: -kv[1][0])}

    def fusions(self) -> dict[str, int]:
        types = self.by_type()
        return {what: types.get(node, (0.0, 0))[1] for what, node in FUSED.items()}

    def reference_us(self) -> float:
        return sum(us for (_, e), us in self.kernel_us.items() if e.startswith("ref")) / self.steps

    def leftover_us(self) -> float:
        return sum(us for (t, _), us in self.kernel_us.items() if t in LEFTOVER) / self.steps


def genai_graph(work: Path, source: Path | None = None) -> Path:
    """openvino_genai's graph of a GGUF (the default model's), built and saved by openvino_genai
    itself (once per file)."""
    source = source or default_model_path()
    folder = work / ("genai-gguf" if source == default_model_path() else f"genai-{source.stem}")
    xml = folder / "openvino_model.xml"
    if not xml.is_file():
        import openvino_genai as og

        folder.mkdir(parents=True, exist_ok=True)
        gguf = folder / "model.gguf"
        if not gguf.is_file():
            shutil.copyfile(source, folder / "model.gguf.tmp")
            (folder / "model.gguf.tmp").replace(gguf)
        print(f"openvino_genai builds its graph of {gguf} ...", file=sys.stderr)
        og.LLMPipeline(str(gguf), "CPU", enable_save_ov_model=True)
        if not xml.is_file():
            raise SystemExit(f"openvino_genai saved no graph in {folder}")
    return xml


def profile(name: str, xml: Path, props: dict[str, Any], steps: int, warmup: int, split: bool) -> Profile:
    core = ov.Core()
    model = core.read_model(xml)
    if split:  # as StageRunner compiles for `fast` (a no-op on integer zero points, as genai's)
        split_zero_points(model)
    compiled = core.compile_model(model, "CPU", props | {"PERF_COUNT": True})
    names = {i.any_name for i in compiled.inputs}
    request = compiled.create_infer_request()
    n = PROMPT
    feed = {"input_ids": np.arange(100, 100 + n, dtype=np.int64)[None], "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32),
            "logits_index": np.array([[n - 1]], np.int64)}
    request.infer({k: v for k, v in feed.items() if k in names})
    out = Profile(name)
    token = int(request.get_output_tensor(0).data[0, -1].argmax())
    for i in range(warmup + steps):
        n += 1
        feed = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.array([[n - 1]], np.int64), "beam_idx": np.zeros(1, np.int32),
                "logits_index": np.zeros((1, 1), np.int64)}
        request.infer({k: v for k, v in feed.items() if k in names})
        token = int(request.get_output_tensor(0).data[0, -1].argmax())
        if i >= warmup:
            out.add(list(request.profiling_info))
    return out


def report(precision: str, ours: Profile, theirs: Profile) -> dict[str, Any]:
    print(f"\n== precision {precision}: microseconds per decode step (sum of node times) ==")
    print(f"{'':44s} {ours.name:>22s} {theirs.name:>22s}")
    print(f"{'total':44s} {ours.per_step():22.0f} {theirs.per_step():22.0f}")
    print("-- fused (node count; 0: not fused) --")
    for what in FUSED:
        print(f"{what:44s} {ours.fusions()[what]:22d} {theirs.fusions()[what]:22d}")
    print(f"{'time in reference kernels':44s} {ours.reference_us():22.0f} {theirs.reference_us():22.0f}")
    print(f"{'time in leftover elementwise/shape nodes':44s} {ours.leftover_us():22.0f} {theirs.leftover_us():22.0f}")
    print("-- by node type as run: us (count) --")
    a, b = ours.by_type(), theirs.by_type()
    for t in sorted(set(a) | set(b), key=lambda t: -max(a.get(t, (0, 0))[0], b.get(t, (0, 0))[0]))[:18]:
        cell = [f"{x[0]:.0f} ({x[1]})" if x[1] else "-" for x in (a.get(t, (0.0, 0)), b.get(t, (0.0, 0)))]
        print(f"{t:44s} {cell[0]:>22s} {cell[1]:>22s}")
    print("-- kernels: us --")
    for (t, e), _ in (ours.kernel_us + theirs.kernel_us).most_common(10):
        print(f"{t + ' / ' + e:44s} {ours.kernel_us[(t, e)] / ours.steps:22.0f} "
              f"{theirs.kernel_us[(t, e)] / theirs.steps:22.0f}")
    print("-- by layer: us --")
    for seg in ("embedding", "layer 0", "layer 1", "layer 14", "layer 29", "norm + head"):
        mine, genai = ours.layer_us.get(seg, 0) / ours.steps, theirs.layer_us.get(seg, 0) / theirs.steps
        print(f"{seg:44s} {mine:22.0f} {genai:22.0f}")
    return {"ours_us": round(ours.per_step()), "genai_us": round(theirs.per_step()),
            "ours_fused": ours.fusions(), "genai_fused": theirs.fusions(),
            "ours_by_type": {t: round(v[0]) for t, v in list(a.items())[:12]},
            "genai_by_type": {t: round(v[0]) for t, v in list(b.items())[:12]},
            "ours_reference_us": round(ours.reference_us()), "genai_reference_us": round(theirs.reference_us())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    ap.add_argument("--weights", default="gguf", choices=("gguf", "int8", "int4"))
    ap.add_argument("--precision", choices=("exact", "fast", "both"), default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="smoke run: fast precision, 8 steps")
    ap.add_argument("--shards", type=Path, help="a 1-stage export to profile (default: the default model's)")
    ap.add_argument("--gguf", type=Path, help="with --shards: the GGUF it came from, for openvino_genai's graph")
    args = ap.parse_args()
    if args.quick:
        args.precision, args.steps, args.warmup = "fast", 8, 2
    quiet, load = wait_quiet(max_wait_s=0 if args.quick else 600)
    ours_xml = (args.shards or shard_folder(args.work, 1, args.weights)) / "stage0.xml"
    theirs_xml = genai_graph(args.work, args.gguf)
    figures: dict[str, Any] = {}
    for precision in (("exact", "fast") if args.precision == "both" else (args.precision,)):
        props: dict[str, Any] = RunConfig(precision=precision, threads=args.threads).ov_properties()
        split = precision == "fast"
        ours = profile(f"shardline ({args.weights})", ours_xml, props, args.steps, args.warmup, split)
        theirs = profile("openvino_genai (GGUF)", theirs_xml, props, args.steps, args.warmup, split)
        figures[precision] = report(precision, ours, theirs)
    ratios = {f"ours_vs_genai_step_{p}": round(f["ours_us"] / f["genai_us"], 3) for p, f in figures.items()}
    print(json.dumps(ratios | {"weights": args.weights, "quiet": quiet, "load_avg_1m": round(load, 2)} | figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
