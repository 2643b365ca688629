"""The paged stage graph against the stateful one (issue 41), in one run, side by side: the
default model as one stage, built both ways from the same weights (export/graph.py,
export/paged.py), on the CPU plugin, nothing else between the calls.

1. Decode: B streams of `--past` tokens each take one token a call; the stateful graph runs them
   as one request of B rows (a decode group), the paged one as B sequences of a flat batch over
   their block tables. Median call time over `--steps` calls, tok/s.
2. Fused: 4 decoding streams and a new prompt's chunk of C tokens. Paged: one call (the chunk
   rides with the decode tokens, Sarathi-style). Stateful: the group's decode call, then the
   chunk's own call on the stream's own request (today's two calls a round).

This measures the graphs alone; the paged runner, scheduler and KV table that serve with them
are issue 41's next parts, and bench/serving.py, interference.py and prefix.py will then measure
`serve`.

    python bench/paged_graph.py            # ~2 min on 2 cores

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import openvino as ov

BLOCK = 32  # the CPU plugin's block (it says so in the compiled key_cache shapes)


def compiled() -> tuple[ov.CompiledModel, ov.CompiledModel, Any]:
    from shardline.config import RunConfig
    from shardline.export.graph import build_stage
    from shardline.export.plan import even_split
    from shardline.export.stateful import make_stateful
    from shardline.export.weights import Weights
    from shardline.model.source import open_source

    source = open_source(None)
    plan = even_split(source.arch.n_layers, 1)[0]
    w, core, props = Weights(source, "gguf"), ov.Core(), RunConfig().ov_properties()
    stateful = core.compile_model(make_stateful(build_stage(source.arch, plan, w)), "CPU", props)
    paged = core.compile_model(build_stage(source.arch, plan, w, paged=True), "CPU", props)
    return stateful, paged, w  # the graphs' constants share w's buffers: keep it alive


def pool(paged: ov.CompiledModel, blocks: int) -> ov.InferRequest:
    request = paged.create_infer_request()
    for i in paged.inputs:
        if "_cache." in i.get_any_name():
            shape = [blocks] + [d.get_length() for d in list(i.get_partial_shape())[1:]]
            request.set_tensor(i.get_any_name(), ov.Tensor(np.zeros(shape, i.get_element_type().to_dtype())))
    return request


def paged_feed(seqs: Sequence[tuple[np.ndarray, int, list[int]]]) -> dict[str, np.ndarray]:
    """(new ids, past, block table) per sequence -> the paged graph's inputs."""
    begins = np.cumsum([0] + [len(ids) for ids, _, _ in seqs]).astype(np.int32)
    return {"input_ids": np.concatenate([ids for ids, _, _ in seqs]).astype(np.int64),
            "position_ids": np.concatenate([np.arange(p, p + len(ids)) for ids, p, _ in seqs]).astype(np.int64),
            "past_lens": np.array([p for _, p, _ in seqs], np.int32), "subsequence_begins": begins,
            "block_indices": np.concatenate([np.asarray(t, np.int32) for _, _, t in seqs]),
            "block_indices_begins": np.cumsum([0] + [len(t) for _, _, t in seqs]).astype(np.int32),
            "max_context_len": np.array(max(p + len(ids) for ids, p, _ in seqs), np.int32),
            "logits_index": (begins[1:] - 1).astype(np.int64)}


def stateful_feed(ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
    b, t = ids.shape
    return {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((b, past + t), np.int64),
            "position_ids": np.tile(np.arange(past, past + t), (b, 1)), "beam_idx": np.arange(b, dtype=np.int32),
            "logits_index": np.full((b, 1), t - 1, np.int64)}


def timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def decode(stateful: ov.CompiledModel, paged: ov.CompiledModel, b: int, past: int, steps: int) -> dict[str, float]:
    ids = np.random.default_rng(b).integers(0, 49152, (b, past))
    per = -(-(past + steps + 1) // BLOCK)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(b)]
    group, flat = stateful.create_infer_request(), pool(paged, b * per)
    group.infer(stateful_feed(ids, 0))
    flat.infer(paged_feed([(ids[r], 0, tables[r]) for r in range(b)]))
    s, p = [], []
    for k in range(steps):
        one = np.zeros((b, 1), np.int64)
        s.append(timed(lambda: group.infer(stateful_feed(one, past + k))))  # noqa: B023 - called at once
        p.append(timed(lambda: flat.infer(paged_feed([(one[r], past + k, tables[r]) for r in range(b)]))))  # noqa: B023
    sm, pm = statistics.median(s), statistics.median(p)
    return {"streams": b, "stateful_ms": sm * 1e3, "paged_ms": pm * 1e3, "paged_speed": sm / pm}


def fused(stateful: ov.CompiledModel, paged: ov.CompiledModel, chunk: int, past: int, rounds: int) -> dict[str, float]:
    b = 4
    per = -(-(past + rounds + 1) // BLOCK)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(b)]
    new_table = list(range(b * per, b * per + -(-chunk // BLOCK)))
    group, flat = stateful.create_infer_request(), pool(paged, b * per + len(new_table))
    ids = np.random.default_rng(chunk).integers(0, 49152, (b, past))
    group.infer(stateful_feed(ids, 0))
    flat.infer(paged_feed([(ids[r], 0, tables[r]) for r in range(b)]))
    s, p = [], []
    for k in range(rounds):
        one = np.zeros((b, 1), np.int64)
        prompt = np.random.default_rng(k).integers(0, 49152, (1, chunk))
        seqs = [(one[r], past + k, tables[r]) for r in range(b)] + [(prompt[0], 0, new_table)]
        p.append(timed(lambda: flat.infer(paged_feed(seqs))))  # noqa: B023
        alone = stateful.create_infer_request()  # the new stream's own request, as the stateful runner opens it
        s.append(timed(lambda: (group.infer(stateful_feed(one, past + k)),  # noqa: B023
                                alone.infer(stateful_feed(prompt, 0)))))  # noqa: B023
    sm, pm = statistics.median(s), statistics.median(p)
    return {"chunk": chunk, "stateful_ms": sm * 1e3, "paged_ms": pm * 1e3, "paged_speed": sm / pm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    stateful, paged, _weights = compiled()
    dec = [decode(stateful, paged, b, args.past, args.steps) for b in (1, 4, 8)]
    fus = [fused(stateful, paged, c, args.past, 8) for c in (64, 256, 512)]
    print("| streams decoding | stateful ms/call | paged ms/call | stateful tok/s | paged tok/s | paged speed |")
    print("|--:|--:|--:|--:|--:|--:|")
    for r in dec:
        b = r["streams"]
        print(f"| {b:.0f} | {r['stateful_ms']:.2f} | {r['paged_ms']:.2f} | {b / r['stateful_ms'] * 1e3:.0f} | "
              f"{b / r['paged_ms'] * 1e3:.0f} | {r['paged_speed']:.2f}x |")
    print()
    print("| 4 decoding + a prompt chunk of | stateful: 2 calls ms | paged: 1 call ms | paged speed |")
    print("|--:|--:|--:|--:|")
    for r in fus:
        print(f"| {r['chunk']:.0f} | {r['stateful_ms']:.1f} | {r['paged_ms']:.1f} | {r['paged_speed']:.2f}x |")
    print(json.dumps({"decode_speed": {str(int(r["streams"])): round(r["paged_speed"], 3) for r in dec},
                      "fused_speed": {str(int(r["chunk"])): round(r["paged_speed"], 3) for r in fus},
                      "decode": dec, "fused": fus}))


if __name__ == "__main__":
    main()
