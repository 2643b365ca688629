"""Decode speed of stage graphs alone, side by side in one process: the graph of one export
against another (an older GRAPH_REVISION, other weights) or against openvino_genai's graph of
the GGUF (issue 12). No pipeline, no threads of ours: one InferRequest per graph, a 46-token
prompt, then greedy steps with the argmax on the host, started with `start_async` + `wait` as
StageRunner does. Repetitions are interleaved across graphs so that noise hits them alike.

    python bench/graphs.py old=/tmp/old-export new=/tmp/shardline-bench/smollm2-...-1stages-f2g4
    python bench/graphs.py --precision exact,fast a=DIR b=DIR
    python bench/graphs.py --precision exact,fast,fast-round ours=DIR   # what rounding the zero points gives

`fast-round` is `--precision rounded`: `fast` with every fractional Q4_1 zero point rounded to
a code, as openvino_genai's GGUF reader does: it changes the weights (by up to half a quantization step per
block), so beside speed the table gives each graph's teacher-forced agreement with the first
graph: the share of positions, over the prompt and the first graph's tokens fed as one prompt,
whose argmax equals the first graph's there.

Each DIR is a 1-stage export (its stage0.xml) or a folder with an openvino_model.xml. The last
line on stdout is one JSON object with the figures, ratios to the first graph first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
from kit import wait_quiet  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig
from shardline.stage.zero_points import round_zero_points, split_zero_points

PROMPT = 46


def graph_xml(folder: Path) -> Path:
    for name in ("stage0.xml", "openvino_model.xml"):
        if (folder / name).is_file():
            return folder / name
    raise SystemExit(f"{folder}: no stage0.xml or openvino_model.xml")


class Graph:
    def __init__(self, xml: Path, props: dict[str, Any], rewrite: str) -> None:
        core = ov.Core()
        model = core.read_model(xml)
        if rewrite == "split":
            split_zero_points(model)
        elif rewrite == "round":
            round_zero_points(model)
        self.compiled = core.compile_model(model, "CPU", props)
        self.names = {i.any_name for i in self.compiled.inputs}

    def _feed(self, ids: np.ndarray, slots: int) -> dict[str, np.ndarray]:
        t = ids.shape[1]
        feed = {"input_ids": ids, "attention_mask": np.ones((1, slots), np.int64),
                "position_ids": np.arange(slots - t, slots, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32),
                "logits_index": np.array([[t - 1]], np.int64)}
        return {k: v for k, v in feed.items() if k in self.names}

    def argmaxes(self, ids: list[int]) -> np.ndarray:
        """The argmax at every position of `ids` fed as one prompt."""
        request = self.compiled.create_infer_request()
        feed = self._feed(np.array([ids], np.int64), len(ids))
        if "logits_index" in feed:
            feed["logits_index"] = np.arange(len(ids), dtype=np.int64)[None]
        request.infer(feed)
        return np.asarray(request.get_output_tensor(0).data[0].argmax(-1))

    def run(self, new: int) -> tuple[float, float, list[int]]:
        """(decode tok/s, TTFT ms, tokens) of one generation."""
        request = self.compiled.create_infer_request()
        slots = PROMPT
        start = time.perf_counter()
        request.infer(self._feed(np.arange(100, 100 + PROMPT, dtype=np.int64)[None], slots))
        ttft = time.perf_counter() - start
        tokens = [int(request.get_output_tensor(0).data[0, -1].argmax())]
        start = time.perf_counter()
        for _ in range(new - 1):
            slots += 1
            request.start_async(self._feed(np.array([[tokens[-1]]], np.int64), slots))
            request.wait()
            tokens.append(int(request.get_output_tensor(0).data[0, -1].argmax()))
        return (new - 1) / (time.perf_counter() - start), ttft * 1e3, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+", metavar="LABEL=DIR")
    ap.add_argument("--precision", default="fast",
                    help="comma-separated: exact, fast (as shardline compiles it: Q4_1 zero points split), "
                         "fast-zp (fast, zero points kept), fast-round (fast, zero points rounded: other weights), "
                         "bf16 (fast with bf16 compute), plugin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = 16, 1
    quiet, load = wait_quiet(max_wait_s=0 if args.quick else 600)
    graphs: dict[str, Graph] = {}
    for precision in args.precision.split(","):
        # bf16: fast with bf16 compute (this CPU has AVX512-BF16); the others as shardline sets them
        base = "fast" if precision in ("bf16", "fast-zp", "fast-round") else precision
        props: dict[str, Any] = RunConfig(precision=base, threads=args.threads).ov_properties()
        if precision == "bf16":
            props["INFERENCE_PRECISION_HINT"] = "bf16"
        for spec in args.graphs:
            label, _, folder = spec.partition("=")
            rewrite = {"fast": "split", "bf16": "split", "fast-round": "round"}.get(precision, "")
            graphs[f"{label} {precision}"] = Graph(graph_xml(Path(folder)), props, rewrite)
    for g in graphs.values():
        g.run(16)  # warm-up
    runs: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in graphs}
    for _ in range(args.reps):
        for name, g in graphs.items():
            runs[name].append(g.run(args.tokens))
    first = next(iter(runs))
    tps = {n: statistics.median(r[0] for r in rs) for n, rs in runs.items()}
    ttft = {n: statistics.median(r[1] for r in rs) for n, rs in runs.items()}
    same = {n: sum(a == b for a, b in zip(runs[first][0][2], rs[0][2], strict=True)) for n, rs in runs.items()}
    fed = list(range(100, 100 + PROMPT)) + runs[first][0][2]
    truth = graphs[first].argmaxes(fed)
    agree = {n: float(np.mean(g.argmaxes(fed) == truth)) for n, g in graphs.items()}
    print(f"{args.tokens} tokens after {PROMPT}, {args.threads} threads, median of {args.reps} interleaved runs")
    print(f"{'graph':34s} {'tok/s':>8s} {'TTFT ms':>8s} {'x first':>8s} {'tokens = first':>15s}"
          f" {'teacher-forced':>15s}")
    for n in runs:
        print(f"{n:34s} {tps[n]:8.1f} {ttft[n]:8.1f} {tps[n] / tps[first]:8.3f} {same[n]:>11d}/{args.tokens}"
              f" {agree[n]:15.3f}")
    ratios = {f"{n}_vs_{first}": round(tps[n] / tps[first], 3) for n in runs if n != first}
    print(json.dumps(ratios | {"tok_s": {n: round(v, 1) for n, v in tps.items()},
                               "ttft_ms": {n: round(v, 1) for n, v in ttft.items()}, "tokens_equal": same,
                               "teacher_forced_agreement": {n: round(v, 3) for n, v in agree.items()},
                               "reps": args.reps, "quiet": quiet, "load_avg_1m": round(load, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
