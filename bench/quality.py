"""Agreement of fp32/fp16/int8/int4/gguf shards with the fp32 transformers reference, on the same weights.

For each precision a 1-stage shard folder of the default model (SmolLM2-135M-Instruct) is run with
each RunConfig precision: "exact" (f32 compute and KV, no int8 activations), "fast" (f32 compute,
int8 activations for compressed weights, u8 KV), "rounded" (fast, GGUF Q4_1 zero points rounded
to whole codes as openvino_genai does) and "plugin" (the CPU plugin's defaults: bf16), and
compared with the reference (transformers, fp32, the very same dequantized weights):
  prefix agreement    share of the N greedy tokens identical up to the first divergence (mean over prompts)
  teacher-forced      the reference's prompt + greedy tokens fed as one prompt step: share of the N positions
                      whose argmax equals the reference's argmax there
  perplexity          of a fixed English text (no chat template), from the logits of one prompt step
Prefix agreement is all-or-nothing at near-ties (a reference top-2 margin of a few hundredths of a
logit flips on any perturbation); teacher-forced agreement is the steadier figure.

    python bench/quality.py            # 8 prompts, 64 tokens, all precisions
    python bench/quality.py --quick    # 2 prompts, 32 tokens, fp32 and gguf
    python bench/quality.py --weights gguf --modes exact --kv f32,f16,u8   # the KV cache's precisions
    python bench/quality.py --weights gguf,gguf-rb64,gguf-rb192 --modes exact,fast   # `export --reblock G`
    python bench/quality.py --model qwen2.5-coder-1.5b --text stdlib --weights gguf,int4 --modes exact,fast

`--model` takes a real model file (a path, or a name of `shardline pull`, pulled if missing): the
reference is then transformers' own GGUF loader on it (fp32), and the prompts are code and chat
(tests/real_models.py). `--text stdlib`: the perplexity text is Python's standard library's own
source (STDLIB_FILES, the first --text-tokens tokens), natural for a code model.

With `--kv`, each run precision is also run with each KV cache precision. A prompt fed in one
step attends to its own keys and values before the cache stores them, so there the text's
logits come from prompt steps of KV_CHUNK tokens, each after the cache of the ones before
(the teacher-forced rows likewise), and greedy tokens read the cache at every step.

The last line on stdout is one JSON object with the figures, agreements and ratios first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from itertools import count
from pathlib import Path

import numpy as np
from kit import TEXT, shard_folder  # bench/ is on sys.path when this script runs

from shardline.config import WEIGHTS, RunConfig, SamplingParams
from shardline.model.source import open_source
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import PrefillStep, run
from shardline.stage.cache import KVBook

_KEYS = count(1)
REPO = Path(__file__).resolve().parents[1]  # for tests.helpers and tests.model.reference (torch, transformers)

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish and German.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about autumn leaves.",
]



STDLIB_FILES = ("textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py", "shlex.py", "string.py")


def stdlib_text() -> str:
    """Python's own library sources, in a fixed order (Python 3.11.7 on these machines)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / name).read_text(encoding="utf-8") for name in STDLIB_FILES)


def reference(model: Path | None):  # type: ignore[no-untyped-def]
    """transformers fp32 on the same dequantized weights: its GGUF loader for a model file."""
    import torch

    if model is None:
        from tests.model.reference import reference_model

        return reference_model(open_source(None))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean next-token negative log-likelihood of ids[1:] under logits[:-1]."""
    x = logits[:-1].astype(np.float64)
    logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return float(np.exp(np.mean(logz - x[np.arange(len(ids) - 1), ids[1:]])))


def prefill_logits(pipe: LocalPipeline, ids: list[int]) -> np.ndarray:
    """The logits at every position of `ids`, fed as one prompt step that samples every position."""
    key, book = next(_KEYS), KVBook()
    inputs = book.plan(ids)
    book.commit(inputs)
    at = np.stack([np.zeros(len(ids), np.int64), np.arange(len(ids), dtype=np.int64)], axis=1)
    try:
        (out,) = run(pipe, PrefillStep(key, (key,), (SamplingParams(),), inputs, at, True, first=True))
    finally:
        pipe.release(key)
    if out.failed:
        raise RuntimeError(out.error)
    return np.stack([np.asarray(c.logits) for c in out.choices])


KV_CHUNK = 16


def chunked_logits(pipe: LocalPipeline, ids: list[int], chunk: int) -> np.ndarray:
    """The logits at every position of `ids`, fed in prompt steps of `chunk` tokens: every step
    after the first attends to the cache as the run's KV precision keeps it."""
    key, book, rows = next(_KEYS), KVBook(), []
    try:
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            inputs = book.plan(part)
            book.commit(inputs)
            at = np.stack([np.zeros(len(part), np.int64), np.arange(len(part), dtype=np.int64)], axis=1)
            (out,) = run(pipe, PrefillStep(key, (key,), (SamplingParams(),), inputs, at, True, first=start == 0))
            if out.failed:
                raise RuntimeError(out.error)
            rows.extend(np.asarray(c.logits) for c in out.choices)
    finally:
        pipe.release(key)
    return np.stack(rows)


def prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated precisions (default: all)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "shardline" / "bench")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 32 tokens, fp32 and gguf")
    p.add_argument("--modes", default="exact,fast,rounded,plugin", help="run precisions (comma-separated)")
    p.add_argument("--kv", default="", help="KV cache precisions to run each mode with (f32,f16,u8; default: "
                                            "the mode's own, prompts in one step)")
    p.add_argument("--model", help="a GGUF file or a name of `shardline pull` (default: the embedded model)")
    p.add_argument("--text", choices=("english", "stdlib"), default="english",
                   help="the perplexity text: kit.TEXT, or the standard library's sources (STDLIB_FILES)")
    p.add_argument("--text-tokens", type=int, default=1024, help="with --text stdlib: how many of its tokens")
    args = p.parse_args()
    weights = ["fp32", "gguf"] if args.quick else args.weights.split(",")
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    if bad := [w for w in weights if w not in WEIGHTS and not re.fullmatch(r"gguf-rb\d+", w)]:
        p.error(f"unknown weights {bad}; choose from {', '.join(WEIGHTS)} or gguf-rbG (re-blocked into groups of G)")
    prompts, n = (PROMPTS[:2], min(args.tokens, 32)) if args.quick else (PROMPTS, args.tokens)
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    from shardline.export.pull import resolve_model

    path = resolve_model(Path(args.model)) if args.model else None
    folders = {w: shard_folder(args.work, 1, w, model=path) for w in weights}

    sys.path.insert(0, str(REPO))
    import torch

    from tests.helpers import greedy_ours
    from tests.model.reference import greedy_reference
    from tests.real_models import PROMPTS as REAL_PROMPTS

    t0 = time.perf_counter()
    tok = ChatTokenizer(folders[weights[0]])
    messages = REAL_PROMPTS[:len(prompts)] if path else [[{"role": "user", "content": t}] for t in prompts]
    chats = [tok.encode_chat(m) for m in messages]
    text_ids = tok.encode(TEXT) if args.text == "english" else tok.encode(stdlib_text())[:args.text_tokens]
    model = reference(path)
    ref_tokens = [greedy_reference(model, c, n)[0] for c in chats]
    forced = [c + r[:-1] for c, r in zip(chats, ref_tokens, strict=True)]  # the last n rows predict r
    with torch.no_grad():
        ref_tf = [model(torch.tensor([s])).logits[0, -n:].float().numpy().argmax(-1) for s in forced]
        ref_text = model(torch.tensor([text_ids])).logits[0].float().numpy()
    ref_ppl = perplexity(ref_text, text_ids)
    print(f"reference: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    rows: dict[str, dict[str, float | str]] = {}
    kvs: list[str | None] = [k for k in args.kv.split(",") if k] or [None]
    runs = [(w, mode, kv) for w in weights for mode in args.modes.split(",") for kv in kvs]
    for w, mode, kv in runs:
        t0 = time.perf_counter()
        pipe = LocalPipeline(folders[w], RunConfig(precision=mode, kv_precision=kv))
        compiled = pipe.stages[0].compiled
        greedy = [greedy_ours(pipe, c, n)[0] for c in chats]
        if kv is None:
            tf = [prefill_logits(pipe, s)[-n:].argmax(-1) for s in forced]
            text = prefill_logits(pipe, text_ids)
        else:
            tf = [chunked_logits(pipe, s, KV_CHUNK)[-n:].argmax(-1) for s in forced]
            text = chunked_logits(pipe, text_ids, KV_CHUNK)
        rows[f"{w}_{mode}" + (f"_kv{kv}" if kv else "")] = {
            "prefix": float(np.mean([prefix_len(g, r) / n for g, r in zip(greedy, ref_tokens, strict=True)])),
            "full": sum(g == r for g, r in zip(greedy, ref_tokens, strict=True)) / len(chats),
            "tf": float(np.mean(np.concatenate([a == b for a, b in zip(tf, ref_tf, strict=True)]))),
            "text_top1": float(np.mean(text.argmax(-1) == ref_text.argmax(-1))),
            "ppl": perplexity(text, text_ids),
            "compute": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
            "kv": compiled.get_property("KV_CACHE_PRECISION").get_type_name(),
        }
        print(f"{w} {mode} {kv or ''}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        pipe.shutdown()
        del pipe, compiled

    print(f"\n{len(chats)} chat prompts x {n} greedy tokens, text {len(text_ids)} tokens, "
          f"load average {load:.1f} at start; reference = transformers fp32 on the same dequantized weights")
    print(f"{'weights/run':<18} {'compute':>8} {'kv':>4} {'prefix agr':>10} {'identical':>9} {'teacher-forced':>14} "
          f"{'text top1':>9} {'perplexity':>10} {'ppl/ref':>7}")
    print(f"{'reference':<18} {'f32':>8} {'f32':>4} {'':>10} {'':>9} {'':>14} {'':>9} {ref_ppl:>10.3f} {1:>7.3f}")
    for k, r in rows.items():
        print(f"{k:<18} {r['compute']:>8} {r['kv']:>4} {r['prefix']:>10.1%} {r['full']:>9.0%} {r['tf']:>14.1%} "
              f"{r['text_top1']:>9.1%} {r['ppl']:>10.3f} {float(r['ppl']) / ref_ppl:>7.3f}")

    figures: dict[str, object] = {}
    for key, name in (("tf", "teacher_forced_agreement"), ("prefix", "prefix_agreement"),
                      ("text_top1", "text_top1_agreement"), ("full", "identical_generations")):
        figures |= {f"{k}_{name}": round(float(r[key]), 4) for k, r in rows.items()}
    figures |= {f"{k}_perplexity_ratio": round(float(r["ppl"]) / ref_ppl, 4) for k, r in rows.items()}
    figures |= {f"{k}_perplexity": round(float(r["ppl"]), 4) for k, r in rows.items()}
    figures |= {
        "model": str(path or "SmolLM2-135M (embedded)"), "text": args.text, "python": sys.version.split()[0],
        "reference_perplexity": round(ref_ppl, 4), "prompts": len(chats), "tokens": n,
        "text_tokens": len(text_ids), "load_avg_1m_at_start": round(load, 2),
        "run_precisions": {k: f"{r['compute']}/{r['kv']}" for k, r in rows.items()},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
