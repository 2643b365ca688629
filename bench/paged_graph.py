"""The paged stage graph against the stateful one (issue 41), in one run, side by side: the
default model as one stage, built both ways from the same weights (export/graph.py,
export/paged.py), on the CPU plugin, nothing else between the calls.

1. Decode: B streams of `--past` tokens each take one token a call; the stateful graph runs them
   as one request of B rows (a decode group), the paged one as B sequences of a flat batch over
   their block tables. Median call time over `--steps` calls, tok/s.
2. Fused: 4 decoding streams and a new prompt's chunk of C tokens. Paged: one call (the chunk
   rides with the decode tokens, Sarathi-style). Stateful: the group's decode call, then the
   chunk's own call on the stream's own request (today's two calls a round).

3. Interference: 2 streams decode (past `--past-long` tokens) while a `--prompt`-token prompt
   arrives. Paged: each step packs both decode tokens and the prompt's next chunk under a token
   budget (serving/ragged.py), one call. Stateful: each round the group's decode call, then a
   chunk of the budget's size on the prompt's own request. Per budget: the longest gap between
   the streams' tokens over the steady gap (decoding alone), their rate while the prompt fills
   over the steady rate, and the prompt's time to its last chunk over that time alone (chunks
   of 512 back to back, nothing else running). The interference issue's targets, at graph
   level: <= 4x, >= 50%, <= 2x.

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
IDLE_CHUNK = 512  # the prompt alone goes in chunks this long: its best time, the TTFT reference


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


def interference(stateful: ov.CompiledModel, paged: ov.CompiledModel, prompt_len: int, past: int,
                 budget: int) -> dict[str, float]:
    from shardline.serving.ragged import Budget, Want, pack

    b, rng = 2, np.random.default_rng(budget)
    per, new_blocks = -(-(past + 400) // BLOCK), -(-prompt_len // BLOCK)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(b)]
    new_table = list(range(b * per, b * per + new_blocks))
    prompt = rng.integers(0, 49152, prompt_len)
    group, flat = stateful.create_infer_request(), pool(paged, b * per + new_blocks)
    ids = rng.integers(0, 49152, (b, past))
    group.infer(stateful_feed(ids, 0))
    flat.infer(paged_feed([(ids[r], 0, tables[r]) for r in range(b)]))
    one = np.zeros((b, 1), np.int64)
    at = [past]  # the streams' past, advanced by every step of either kind (both graphs alike)

    def decode_alone() -> tuple[float, float]:
        s = timed(lambda: group.infer(stateful_feed(one, at[0])))
        p = timed(lambda: flat.infer(paged_feed([(one[r], at[0], tables[r]) for r in range(b)])))
        at[0] += 1
        return s, p
    steady = [decode_alone() for _ in range(12)]
    steady_s, steady_p = statistics.median(x for x, _ in steady), statistics.median(y for _, y in steady)
    # the prompt alone (its chunks back to back), both kinds, on scratch requests / blocks
    alone = stateful.create_infer_request()
    idle_s = sum(timed(lambda: alone.infer(stateful_feed(prompt[None, k : k + IDLE_CHUNK], k)))  # noqa: B023
                 for k in range(0, prompt_len, IDLE_CHUNK))
    scratch = pool(paged, new_blocks)
    idle_p = sum(timed(lambda: scratch.infer(paged_feed([(prompt[k : k + IDLE_CHUNK], k, list(range(new_blocks)))])))  # noqa: B023
                 for k in range(0, prompt_len, IDLE_CHUNK))
    # loaded: stateful two calls a round; paged one packed call a step
    request = stateful.create_infer_request()
    gaps_s, done = [], 0
    while done < prompt_len:
        n = min(budget, prompt_len - done)
        gaps_s.append(timed(lambda: (group.infer(stateful_feed(one, at[0])),  # noqa: B023
                                     request.infer(stateful_feed(prompt[None, done : done + n], done)))))  # noqa: B023
        done += n
        at[0] += 1
    gaps_p, done = [], 0
    while done < prompt_len:
        plan = pack([Want(0, 1, True), Want(1, 1, True), Want(2, prompt_len - done, False)], Budget(budget + b))
        n = dict(plan).get(2, 0)
        seqs = [(one[r], at[0], tables[r]) for r in range(b)] + [(prompt[done : done + n], done, new_table)]
        gaps_p.append(timed(lambda: flat.infer(paged_feed(seqs))))  # noqa: B023
        done += n
        at[0] += 1
    return {"budget": budget,
            "stateful_max_gap": max(gaps_s) / steady_s, "paged_max_gap": max(gaps_p) / steady_p,
            "stateful_rate": steady_s / statistics.mean(gaps_s), "paged_rate": steady_p / statistics.mean(gaps_p),
            "stateful_ttft": sum(gaps_s) / idle_s, "paged_ttft": sum(gaps_p) / idle_p,
            "steady_ms_stateful": steady_s * 1e3, "steady_ms_paged": steady_p * 1e3,
            "idle_s_stateful": idle_s, "idle_s_paged": idle_p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--past-long", type=int, default=600)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--budgets", default="16,32,64")
    args = ap.parse_args()
    stateful, paged, _weights = compiled()
    dec = [decode(stateful, paged, b, args.past, args.steps) for b in (1, 4, 8)]
    fus = [fused(stateful, paged, c, args.past, 8) for c in (64, 256, 512)]
    inter = [interference(stateful, paged, args.prompt, args.past_long, int(x)) for x in args.budgets.split(",")]
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
    print()
    print(f"| prompt of {args.prompt} while 2 streams decode: budget (chunk) | longest gap / steady: stateful | paged "
          "| rate during it / steady: stateful | paged | TTFT / alone: stateful | paged |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for r in inter:
        print(f"| {r['budget']:.0f} | {r['stateful_max_gap']:.1f}x | {r['paged_max_gap']:.1f}x | "
              f"{r['stateful_rate']:.0%} | {r['paged_rate']:.0%} | {r['stateful_ttft']:.2f}x | "
              f"{r['paged_ttft']:.2f}x |")
    print(json.dumps({"interference": {str(int(r["budget"])): {k: round(v, 3) for k, v in r.items() if k != "budget"}
                                       for r in inter},
                      "decode_speed": {str(int(r["streams"])): round(r["paged_speed"], 3) for r in dec},
                      "fused_speed": {str(int(r["chunk"])): round(r["paged_speed"], 3) for r in fus},
                      "decode": dec, "fused": fus}))


if __name__ == "__main__":
    main()
