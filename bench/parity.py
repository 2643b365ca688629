"""Decode speed of shardline (1, 2, 3 stages) against openvino_genai and llama.cpp, in one run.

Every system runs the same chat prompt (same token ids), greedy, with the same thread count,
and generates exactly N new tokens (stop tokens ignored). Repetitions are interleaved across
systems so that noise from a shared machine hits them alike; medians are reported.

    python bench/parity.py                 # int8, fast precision, 128 tokens, 3 reps, 2 threads
    python bench/parity.py --weights gguf --quick

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
from kit import shard_folder  # bench/ is on sys.path when this script runs

from shardline.config import RunConfig, SamplingParams
from shardline.model.source import default_model_path
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import Outcome, Step, decode, prefill
from shardline.pipeline.plan import run as run_step
from shardline.stage.block_ops import read_stage
from shardline.stage.cache import KVBook

GREEDY = SamplingParams()
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Sample:
    """One generation of N tokens: time to first token, time for the N-1 tokens after it."""

    ttft_s: float
    decode_s: float
    tokens: list[int]
    graph_s: list[float] = field(default_factory=list)  # per stage, decode steps only (shardline)


Runner = Callable[[list[int], int], Sample]


# --- shardline ---------------------------------------------------------------------------------


def shardline_runner(folder: Path, run_cfg: RunConfig) -> Runner:
    """The in-process pipeline as shardline runs it (every stage on its own thread): one
    prefill step, then one decode step per token, each waited for. Graph time per stage comes
    from each outcome's timing; host is the rest (planning, thread hand-offs, sampling)."""
    pipe = LocalPipeline(folder, run_cfg)
    keys = count(1)

    def one(step: Step) -> Outcome:
        (out,) = run_step(pipe, step)
        if out.failed:
            raise RuntimeError(out.error)
        return out

    def run(prompt: list[int], n: int) -> Sample:
        graph = [0.0] * pipe.n_stages
        key, book = next(keys), KVBook()
        t0 = time.perf_counter()
        try:
            out = one(prefill(key, book, prompt, GREEDY, first=True, last=True))
            tokens = [out.choices[0].token]
            ttft = time.perf_counter() - t0
            for _ in range(n - 1):
                out = one(decode(key, book, [tokens[-1]], GREEDY))
                tokens.append(out.choices[0].token)
                assert out.timing is not None
                for k, g in out.timing.graph_s.items():
                    graph[k] += g
        finally:
            pipe.release(key)
        return Sample(ttft, time.perf_counter() - t0 - ttft, tokens, graph)

    return run


# --- openvino_genai ----------------------------------------------------------------------------


def genai_ir_folder(work: Path, shards: Path) -> Path:
    """A folder LLMPipeline loads, made from a 1-stage shardline export (no optimum involved)."""
    folder = work / f"genai-ir-{shards.name}"
    if (folder / "openvino_detokenizer.xml").is_file():
        return folder
    import openvino as ov
    from openvino import save_model
    from openvino_tokenizers import convert_tokenizer
    from transformers import PreTrainedTokenizerFast

    from shardline.model.manifest import load_manifest

    tmp = work / f".{folder.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = load_manifest(shards)
    (stage,) = manifest.stages
    graph, _ = read_stage(ov.Core(), shards / stage.xml, RunConfig())  # genai runs the plugin's form
    save_model(last_position_logits(graph), tmp / "openvino_model.xml", compress_to_fp16=False)
    cfg = json.loads((shards / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(shards / "tokenizer.json"), eos_token=cfg.get("eos_token"),
        bos_token=cfg.get("bos_token"), chat_template=cfg.get("chat_template"),
    )
    tok, detok = convert_tokenizer(hf, with_detokenizer=True)
    save_model(tok, tmp / "openvino_tokenizer.xml")
    save_model(detok, tmp / "openvino_detokenizer.xml")
    hf.save_pretrained(tmp)
    a = manifest.arch
    eos = hf.convert_tokens_to_ids(hf.eos_token)
    bos = hf.convert_tokens_to_ids(hf.bos_token) if hf.bos_token else eos
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": a.family, "hidden_size": a.hidden,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.intermediate,
        "vocab_size": a.vocab, "rope_theta": a.rope_theta, "rms_norm_eps": a.rms_eps,
        "max_position_embeddings": a.max_context, "tie_word_embeddings": a.tied_embeddings,
        "bos_token_id": bos, "eos_token_id": eos,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    tmp.rename(folder)
    return folder


def last_position_logits(model: Any) -> Any:
    """The 1-stage graph with its `logits_index` input (manifest format 2: which positions get
    logits) replaced by the last position of every row, computed from the shape of input_ids:
    what openvino_genai feeds is input_ids, attention_mask, position_ids and beam_idx only, and
    it reads the logits of the last position. Same graph otherwise (same weights, same nodes)."""
    import numpy as np
    import openvino.opset15 as ops

    (index,) = [p for p in model.get_parameters() if p.get_friendly_name() == "logits_index"]
    ids = next(p for p in model.get_parameters() if p.get_friendly_name() == "input_ids")
    shape = ops.shape_of(ids, "i64")
    b = ops.gather(shape, np.array([0], np.int64), np.int64(0))
    last = ops.subtract(ops.gather(shape, np.array([1], np.int64), np.int64(0)), np.array([1], np.int64))
    rows = ops.broadcast(ops.reshape(last, np.array([1, 1], np.int64), False),
                         ops.concat([b, np.array([1], np.int64)], 0))
    for target in list(index.output(0).get_target_inputs()):
        target.replace_source_output(rows.output(0))
    model.remove_parameter(index)
    model.validate_nodes_and_infer_types()
    return model


def genai_runner(model: Path, props: dict[str, str]) -> Runner:
    import openvino as ov
    import openvino_genai as og

    # SDPA: the stateful graph as it is (the backend shardline's stages use as well).
    pipe = og.LLMPipeline(str(model), "CPU", ATTENTION_BACKEND="SDPA", **props)

    def run(prompt: list[int], n: int) -> Sample:
        cfg = og.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = n
        cfg.ignore_eos, cfg.do_sample = True, False
        out = pipe.generate(ov.Tensor(np.asarray([prompt], dtype=np.int64)), cfg)
        pm = out.perf_metrics
        tokens = [int(t) for t in out.tokens[0]]
        if len(tokens) != n:
            raise RuntimeError(f"genai generated {len(tokens)} tokens, not {n}")
        ttft = pm.get_ttft().mean / 1e3
        return Sample(ttft, pm.get_tpot().mean / 1e3 * (n - 1), tokens)

    return run


# --- llama.cpp ---------------------------------------------------------------------------------


def llamacpp_runner(gguf: Path, threads: int, extra_bufts: bool) -> Runner:
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    # Llama() takes no use_extra_bufts argument: set it on the default params it starts from.
    # Extra buffer types are where llama.cpp's AMX kernels live (Q4_1 goes there on an AMX CPU);
    # on this VM they die with SIGILL on `tilezero`, so they are off unless --llama-extra-bufts.
    default = lc.llama_model_default_params

    def params() -> lc.llama_model_params:
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    lc.llama_model_default_params = params
    try:
        llm = llama_cpp.Llama(
            str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False
        )
    finally:
        lc.llama_model_default_params = default
    vocab = llm.n_vocab()

    def run(prompt: list[int], n: int) -> Sample:
        llm.reset()  # forget the previous rep's cache (eval would otherwise reuse the prompt)
        tokens: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        feed = prompt
        for i in range(n):
            llm.eval(feed)
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            tokens.append(int(np.argmax(logits)))
            if i == 0:
                ttft = time.perf_counter() - t0
            feed = tokens[-1:]
        return Sample(ttft, time.perf_counter() - t0 - ttft, tokens)

    return run


# --- report ------------------------------------------------------------------------------------


def agree(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def print_table(samples: dict[str, list[Sample]], tps: dict[str, float], ttft: dict[str, float],
                errors: dict[str, str], n: int) -> None:
    ref = samples["shardline-1stage"][0].tokens if "shardline-1stage" in samples else []
    print(f"{'system':<22}{'decode tok/s':>14}{'TTFT ms':>10}{'same as 1stage':>16}")
    for k in samples:
        same = f"{agree(ref, samples[k][0].tokens)}/{n}" if ref else "-"
        print(f"{k:<22}{tps[k]:>14.1f}{ttft[k]:>10.1f}{same:>16}")
    for k, e in errors.items():
        print(f"{k:<22}  FAILED: {e}")


def print_breakdown(samples: dict[str, list[Sample]], n: int) -> dict[str, dict[str, float]]:
    """Per decode token: time in each stage.run (graph) and everything else (host), medians over reps."""
    out: dict[str, dict[str, float]] = {}
    print("\nshardline decode, ms per token: graph (stage.run, per stage) + host (all the rest: planning, "
          "thread hand-offs, sampling)")
    for key, runs in samples.items():
        if not key.startswith("shardline-"):
            continue
        ms = 1e3 / (n - 1)
        total = statistics.median(x.decode_s for x in runs) * ms
        graph = [statistics.median(g) * ms for g in zip(*(x.graph_s for x in runs), strict=True)]
        host = statistics.median(x.decode_s - sum(x.graph_s) for x in runs) * ms  # per rep, then median
        parts = {"total": total, "graph": sum(graph), "host": host}
        parts |= {f"stage{k}": g for k, g in enumerate(graph)}
        out[key] = {f"{k}_ms": round(v, 3) for k, v in parts.items()}
        stages = " + ".join(f"{g:.2f}" for g in graph)
        print(f"{key:<22}total {total:6.2f} = graph {sum(graph):6.2f} ({stages}) + host {host:5.2f}"
              f" ({100 * host / total:.1f}%)")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="int8", choices=("int8", "gguf", "int4", "fp16", "fp32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fast", choices=("fast", "exact", "rounded", "plugin"),
                   help="shardline's RunConfig precision, also applied to genai on the same IR")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 1 rep")
    p.add_argument("--systems", help="only the systems whose name contains one of these (comma-separated)")
    p.add_argument("--llama-extra-bufts", action="store_true",
                   help="let llama.cpp use its extra buffer types (AMX, repacked weights)")
    args = p.parse_args()
    n, reps = (16, 1) if args.quick else (args.tokens, args.reps)
    if n < 2:
        p.error("--tokens must be at least 2")
    args.work.mkdir(parents=True, exist_ok=True)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores - args.threads + 0.5:
        print(f"warning: load average {load:.1f} on {cores} cores: other work will skew the figures "
              "(llama.cpp's spinning threads suffer most)", file=sys.stderr)
    gguf = default_model_path()
    folders = {s: shard_folder(args.work, s, args.weights) for s in (1, 2, 3)}
    prompt = ChatTokenizer(folders[1]).encode_chat([{"role": "user", "content": PROMPT}])

    # shardline and genai-on-the-same-IR run with the same OpenVINO properties (--precision);
    # genai on the GGUF file keeps its own defaults (bf16 compute on this CPU).
    run_cfg = RunConfig(precision=args.precision, threads=args.threads)
    makers: dict[str, Callable[[], Runner]] = {
        f"shardline-{s}stage": (lambda f=f: shardline_runner(f, run_cfg)) for s, f in folders.items()
    }
    if args.precision != "exact":
        exact = RunConfig(precision="exact", threads=args.threads)
        makers["shardline-1stage-exact"] = lambda: shardline_runner(folders[1], exact)
    if args.precision == "rounded":  # beside it, what keeps the GGUF's weights
        fast = RunConfig(precision="fast", threads=args.threads)
        makers["shardline-1stage-fast"] = lambda: shardline_runner(folders[1], fast)
    ir = f"genai-ir-{args.weights}"
    makers[ir] = lambda: genai_runner(genai_ir_folder(args.work, folders[1]), run_cfg.ov_properties())
    makers["genai-gguf"] = lambda: genai_runner(gguf, {"INFERENCE_NUM_THREADS": str(args.threads)})
    makers["llama.cpp-gguf"] = lambda: llamacpp_runner(gguf, args.threads, args.llama_extra_bufts)
    if args.systems:
        makers = {k: v for k, v in makers.items() if any(w in k for w in args.systems.split(","))}

    runners: dict[str, Runner] = {}
    errors: dict[str, str] = {}
    for name, make in makers.items():
        try:
            runners[name] = make()
            runners[name](prompt, 4)  # warm-up: compile caches, first-inference allocations
        except Exception as e:  # report and go on with the other systems
            traceback.print_exc(file=sys.stderr)
            errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            runners.pop(name, None)
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    for r in range(reps):
        for name, run in runners.items():
            samples[name].append(run(prompt, n))
            s = samples[name][-1]
            print(f"rep {r + 1}/{reps} {name}: ttft {s.ttft_s * 1e3:.1f} ms, "
                  f"{(n - 1) / s.decode_s:.1f} tok/s", file=sys.stderr)

    tps = {k: statistics.median((n - 1) / s.decode_s for s in v) for k, v in samples.items()}
    ttft = {k: statistics.median(s.ttft_s * 1e3 for s in v) for k, v in samples.items()}
    print(f"\n{n} new tokens, prompt {len(prompt)} tokens, {args.threads} threads, "
          f"weights {args.weights}, median of {reps}, load average {load:.1f} at start")
    print_table(samples, tps, ttft, errors, n)
    breakdown = print_breakdown(samples, n)
    figures = {
        "ratio_1stage_vs_genai_ir": ratio(tps.get("shardline-1stage"), tps.get(ir)),
        "ratio_3stage_vs_1stage": ratio(tps.get("shardline-3stage"), tps.get("shardline-1stage")),
        "ratio_1stage_vs_llamacpp": ratio(tps.get("shardline-1stage"), tps.get("llama.cpp-gguf")),
        "ratio_genai_gguf_vs_llamacpp": ratio(tps.get("genai-gguf"), tps.get("llama.cpp-gguf")),
        "ratio_2stage_vs_1stage": ratio(tps.get("shardline-2stage"), tps.get("shardline-1stage")),
        "ratio_genai_ir_vs_llamacpp": ratio(tps.get(ir), tps.get("llama.cpp-gguf")),
        "ratio_1stage_exact_vs_1stage": ratio(tps.get("shardline-1stage-exact"), tps.get("shardline-1stage")),
        "weights": args.weights, "precision": args.precision, "threads": args.threads, "tokens": n, "reps": reps,
        "prompt_tokens": len(prompt), "load_avg_1m_at_start": round(load, 2),
        "llama_extra_bufts": args.llama_extra_bufts,
        "decode_tok_s": {k: round(v, 2) for k, v in tps.items()},
        "ttft_ms": {k: round(v, 2) for k, v in ttft.items()},
        "shardline_breakdown_ms_per_token": breakdown,
        "errors": errors,
    }
    print("\nratios (decode tok/s): " + ", ".join(f"{k[6:]} {v}" for k, v in figures.items()
                                                  if k.startswith("ratio_")))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
