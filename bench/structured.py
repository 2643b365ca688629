"""Constrained decoding's cost (issue 40), in one run, side by side.

Part 1, the grammar engines on PyPI with CPU wheels, on the default model's vocabulary (49,152
tokens) and Qwen2.5's (151,936, from `shardline pull qwen2.5-coder-0.5b` when present):
llguidance (what serving uses: decoding/masks.py, model/grammar.py), xgrammar and outlines-core,
for a small schema and a large one (40 properties, nested). Per engine: the time to compile the
schema (cold, nothing cached) and the time to compute one token's mask, walked along a valid
instance's tokens (median and p99 over positions).

Part 2, the default model served: a constrained request against the same request unconstrained
(forced to the same number of tokens: ignore_eos, max_tokens = the constrained output's length),
one at a time, greedy, in process (the default 2-stage export) and through 2 worker processes (a
3-stage export, stage 0 here: the last stage, which applies the masks, is a worker). Time per
output token: the median gap between consecutive tokens over all rounds (interleaved, order
alternating); the cost is constrained / plain - 1. Beside it, the grammar's own work per token
(masks, draft checks, advancing: timed around the stream's constraint), as a share of a plain
step. Masks are computed while the step runs (decoding/masks.LateMasks), so that time overlaps
the forward pass rather than adding to it; it is longer than alone, sharing the 2 cores. Target
(issue 40): <= 5% of a decode step, with compilation cached per schema.

    python bench/structured.py              # ~8 min on 2 cores
    python bench/structured.py --rounds 1 --no-workers

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit import shard_folder, worker  # bench/ is on sys.path when this script runs

SMALL: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
MIN_GAPS = 600  # per side, in part 2
SMALL_EXAMPLE = {"name": "Ada Lovelace", "age": 36, "languages": ["Python", "C"]}


def large_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """40 properties: 30 flat ones of four types and 10 nested objects of 3, and an example."""
    props: dict[str, Any] = {}
    example: dict[str, Any] = {}
    kinds = [({"type": "string"}, "value"), ({"type": "integer"}, 42), ({"type": "number"}, 1.5),
             ({"type": "boolean"}, True)]
    for i in range(30):
        schema, value = kinds[i % 4]
        props[f"field_{i}"], example[f"field_{i}"] = schema, value
    inner = {"type": "object", "additionalProperties": False, "required": ["id", "label", "tags"],
             "properties": {"id": {"type": "integer"}, "label": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}}}}
    for i in range(10):
        props[f"group_{i}"], example[f"group_{i}"] = inner, {"id": i, "label": f"group {i}", "tags": ["a", "b"]}
    return ({"type": "object", "additionalProperties": False, "required": list(props), "properties": props},
            example)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def pcts(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return statistics.median(s) * 1e6, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6


# --- part 1: the engines -------------------------------------------------------------------------

Walk = Callable[[Path, int, int, dict[str, Any], list[int]], dict[str, float]]


def llguidance_walk(folder: Path, vocab: int, end: int, schema: dict[str, Any], ids: list[int]) -> dict[str, float]:
    import llguidance
    import numpy as np

    from shardline.model.grammar import JSON_OPTIONS

    lt = llguidance.LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=[end])
    grammar = json.dumps(schema)
    compile_s, m = timed(lambda: llguidance.LLMatcher(
        lt, llguidance.LLMatcher.grammar_from_json_schema(grammar, overrides=JSON_OPTIONS)))
    row = np.empty((vocab + 31) // 32, np.int32)
    times = []
    for t in ids:
        dt, _ = timed(lambda: m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4))
        times.append(dt)
        assert m.consume_token(t), m.get_error()
    return {"compile_ms": compile_s * 1e3, **dict(zip(("mask_us_p50", "mask_us_p99"), pcts(times), strict=True))}


def xgrammar_walk(folder: Path, vocab: int, end: int, schema: dict[str, Any], ids: list[int]) -> dict[str, float]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[end])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compile_s, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                    separators=(", ", ": ")))
    m = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        dt, _ = timed(lambda: m.fill_next_token_bitmask(bitmask))
        times.append(dt)
        assert m.accept_token(t)
    return {"compile_ms": compile_s * 1e3, **dict(zip(("mask_us_p50", "mask_us_p99"), pcts(times), strict=True))}


def outlines_walk(folder: Path, vocab: int, end: int, schema: dict[str, Any], ids: list[int]) -> dict[str, float]:
    import numpy as np
    import outlines_core
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words: dict[str, list[int]] = {}
    for i in range(tk.get_vocab_size()):
        if i != end:  # outlines-core keeps the end token apart (its eos)
            words.setdefault(tk.decode([i], skip_special_tokens=False), []).append(i)
    vocabulary = outlines_core.Vocabulary(end, words)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
    compile_s, index = timed(lambda: outlines_core.Index(regex, vocabulary))
    guide = outlines_core.Guide(index)
    mask = np.zeros((vocab + 31) // 32, np.int32)
    times = []
    for t in ids:
        dt, _ = timed(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4))
        times.append(dt)
        guide.advance(t)
    return {"compile_ms": compile_s * 1e3, **dict(zip(("mask_us_p50", "mask_us_p99"), pcts(times), strict=True))}


WALKS: dict[str, Walk] = {"llguidance": llguidance_walk, "xgrammar": xgrammar_walk, "outlines-core": outlines_walk}


def engines(vocabs: dict[str, Path], schemas: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    from tokenizers import Tokenizer

    from shardline.model.tokenizer import ChatTokenizer

    rows = []
    for vname, folder in vocabs.items():
        tok_json = (folder / "tokenizer.json").read_text()
        chat = ChatTokenizer(folder)
        vocab = max(Tokenizer.from_str(tok_json).get_vocab_size(), chat.vocab_size)
        for sname, (schema, example) in schemas.items():
            ids = chat.tokens(json.dumps(example, separators=(", ", ": ")))
            for name, walk in WALKS.items():
                got: dict[str, Any]
                try:
                    got = walk(folder, vocab, chat.eos_id, schema, ids)
                except Exception as e:  # noqa: BLE001 - an engine that cannot run here is a row that says so
                    got = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                rows.append({"vocab": vname, "schema": sname, "engine": name, "tokens": len(ids), **got})
                print(f"  {vname} {sname} {name}: {got}", file=sys.stderr)
    return rows


# --- part 2: served on the default model ---------------------------------------------------------

def gaps(engine: Any, prompt: list[int], n: int, stop: frozenset[int],
         constraint: Any) -> tuple[list[float], list[int]]:
    """Seconds between consecutive output tokens, and the tokens."""
    import threading

    from shardline.config import SamplingConfig
    from shardline.serving.engine import Event, Request

    times: list[float] = []
    tokens: list[int] = []
    done = threading.Event()

    def on(ev: Event) -> None:
        if ev.token is not None:
            times.append(time.perf_counter())
            tokens.append(ev.token)
        if ev.finish:
            done.set()

    engine.submit(Request(prompt, SamplingConfig(max_tokens=n), stop, False, constraint=constraint), on)
    assert done.wait(600)
    return [b - a for a, b in zip(times, times[1:], strict=False)], tokens


class Timed:
    """A stream's constraint that adds the seconds its grammar work takes to `spent` (the
    coordinator's share of a constrained token: masks, draft checks, advancing)."""

    def __init__(self, inner: Any, spent: list[float]) -> None:
        self.inner, self.spent = inner, spent

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn

        def timed_call(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.spent.append(time.perf_counter() - start)
        return timed_call


def served(folder: Path, workers: list[str] | None, rounds: int, schema: dict[str, Any], ask: str) -> dict[str, float]:
    from shardline.config import RunConfig, ServeConfig
    from shardline.model.grammar import Grammars, GrammarSpec
    from shardline.model.manifest import load_manifest
    from shardline.model.tokenizer import ChatTokenizer
    from shardline.server import open_engine

    tok = ChatTokenizer(folder)
    grammars = Grammars((folder / "tokenizer.json").read_text(), load_manifest(folder).arch.vocab, tok.stop_ids)
    spec = GrammarSpec.json_schema(schema)
    grammars.compile(spec)  # cached per schema, as serving does: compile time is part 1's
    prompt = tok.encode_chat([{"role": "user", "content": ask}])
    engine, _ = open_engine(folder, RunConfig(), ServeConfig(decode_groups=0), workers,
                            activations="f32" if workers else None)
    try:
        gaps(engine, prompt, 8, frozenset(), None)  # warm
        plain: list[float] = []
        constrained: list[float] = []
        spent: list[float] = []
        n = 0
        r = 0
        # interleaved, the order alternating: drift hits both alike; short answers get more rounds
        # (up to 10x) until each side has MIN_GAPS gaps: their medians are otherwise within noise
        while r < rounds or (len(constrained) < MIN_GAPS and r < 10 * rounds):
            first_plain = r % 2 == 1 and n > 0
            if first_plain:
                plain += gaps(engine, prompt, n, frozenset(), None)[0]
            g, tokens = gaps(engine, prompt, 256, frozenset(tok.stop_ids), Timed(grammars.constraint(spec), spent))
            constrained += g
            n = len(tokens)
            if not first_plain:
                plain += gaps(engine, prompt, n, frozenset(), None)[0]
            r += 1
    finally:
        engine.shutdown()
    cp, pp = statistics.median(constrained), statistics.median(plain)
    grammar = sum(spent) / max(1, len(constrained) + r)
    return {"tokens": n, "plain_ms": pp * 1e3, "constrained_ms": cp * 1e3, "cost": cp / pp - 1,
            "grammar_ms": grammar * 1e3, "grammar_share": grammar / pp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/shardline-bench"))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--no-workers", action="store_true")
    args = p.parse_args()

    from shardline.export.pull import pulled_path
    from shardline.model.catalog import named
    from shardline.model.source import open_source

    two = shard_folder(args.work, 2)
    vocabs = {"smollm2 (49k)": two}
    qwen = pulled_path(named("qwen2.5-coder-0.5b"))
    if qwen.is_file():
        folder = args.work / "qwen-tokenizer"
        folder.mkdir(parents=True, exist_ok=True)
        open_source(qwen).tokenizer_files(folder)
        vocabs["qwen2.5 (152k)"] = folder
    large, large_example = large_schema()
    schemas = {"small": (SMALL, SMALL_EXAMPLE), "large (40 props)": (large, large_example)}
    rows = engines(vocabs, schemas)

    runs: dict[str, dict[str, float]] = {}
    ask = "Describe a programmer as JSON."
    for sname, (schema, _) in schemas.items():
        runs[f"in process, {sname}"] = served(two, None, args.rounds, schema, ask)
        print(f"  in process {sname}: {runs[f'in process, {sname}']}", file=sys.stderr)
    if not args.no_workers:
        three = shard_folder(args.work, 3)
        ws = [worker(three, 1), worker(three, 2)]
        try:
            for sname, (schema, _) in schemas.items():
                runs[f"2 workers, {sname}"] = served(three, [w.addr for w in ws], args.rounds, schema, ask)
                print(f"  2 workers {sname}: {runs[f'2 workers, {sname}']}", file=sys.stderr)
        finally:
            for w in ws:
                w.stop()

    print("| vocabulary | schema | engine | tokens | compile ms | mask us p50 | mask us p99 |")
    print("|---|---|---|--:|--:|--:|--:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['vocab']} | {r['schema']} | {r['engine']} | {r['tokens']} | {r['error']} | | |")
        else:
            print(f"| {r['vocab']} | {r['schema']} | {r['engine']} | {r['tokens']} | {r['compile_ms']:.2f} | "
                  f"{r['mask_us_p50']:.0f} | {r['mask_us_p99']:.0f} |")
    print()
    print("| placement, schema | tokens | plain ms/token | constrained ms/token | cost | grammar ms/token "
          "| grammar share |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for name, r in runs.items():
        print(f"| {name} | {r['tokens']} | {r['plain_ms']:.2f} | {r['constrained_ms']:.2f} | {r['cost']:+.1%} | "
              f"{r['grammar_ms']:.3f} | {r['grammar_share']:.1%} |")
    figures = {"cost": {k: round(v["cost"], 4) for k, v in runs.items()},
               "grammar_share": {k: round(v["grammar_share"], 4) for k, v in runs.items()},
               "engines": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
               "served": {k: {m: round(x, 3) for m, x in v.items()} for k, v in runs.items()}}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
