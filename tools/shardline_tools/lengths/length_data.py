"""The length predictor's dataset: varied chat prompts, each with the model's real output length.

    python -m shardline_tools.lengths.length_data --shards FOLDER --out FILE --prompts N

Prompts come from templates (12 task kinds, from a one-word answer to an essay, crossed with
60 topics and a few phrasings each), drawn with a seed. Each is answered greedily by the export
in FOLDER through the serving engine, several at once, up to `--max-tokens` (recorded: an
answer that reaches it is censored, its true length is at least that), stopping at the chat
template's stop tokens as `shardline generate` does. The features (features.py) are computed
by a stage 0 of its own.

Offline tool, but it sits in disagg/, which may not import server.py or export/: the engine is
assembled here from the pipeline and serving layers as `server.open_engine` assembles it for
local stages (no speculation, a fixed stream count), and the folder is given (the default
model's cached export is printed by
`python -c "from shardline.export.defaults import default_shards; print(default_shards())"`).

Output: JSON lines, written atomically (temp file, then rename). The first line is a header
(max_tokens, seed, model hash, what the features are); each other line is one prompt: its
text, kind, topic, prompt tokens, output length, finish ("stop" or "length") and its features
as base64 of little-endian f32 (exact and about a third of the size of JSON numbers).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardline.config import DEFAULT_PREFILL_CHUNK, RunConfig, SamplingConfig
from shardline.disagg.features import FEATURE_KIND, FeatureExtractor
from shardline.disagg.files import write_text_atomic
from shardline.errors import ShardlineError
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request, Ticket
from shardline.serving.scheduler import SchedulerConfig

FORMAT = "shardline-lengths"
VERSION = 1
DEFAULT_MAX_TOKENS = 384  # 3 x the 128-token light/heavy decode threshold; above most answers
DEFAULT_CONCURRENCY = 8  # streams batched in one decode group: the engine's throughput, not its latency
DEFAULT_TIME_LIMIT_S = 3600.0

TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the moon", "bread", "electricity", "chess", "the Roman Empire",
    "photosynthesis", "rainbows", "coffee", "elephants", "the internet", "glaciers", "jazz music", "football",
    "democracy", "vaccines", "trains", "deserts", "clouds", "money", "dinosaurs", "recycling", "sleep",
    "mountains", "cats", "solar panels", "the human heart", "gardening", "bicycles", "tea", "earthquakes",
    "libraries", "robots", "the printing press", "salt", "owls", "rivers", "batteries", "airplanes", "bridges",
    "the immune system", "pyramids", "penguins", "cheese", "telescopes", "forests", "the stock market",
    "smartphones", "yoga", "rice", "lighthouses", "mushrooms", "the Olympic Games", "snow", "wind turbines",
    "spiders", "maps", "chocolate",
]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
CODE_TASKS = [
    "returns the sum of a list of numbers", "reverses a string", "checks whether a number is prime",
    "counts the vowels in a string", "returns the largest element of a list", "computes the factorial of n",
    "merges two sorted lists", "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome", "sorts a list of words by length",
]
SENTENCES = [  # the "given text" of summaries and the sentences to translate
    "People have been curious about {t} for a very long time.", "Scientists still study {t} in many countries.",
    "Some people think {t} is simple, but it is more complicated than it looks.",
    "In many schools, children learn about {t} at an early age.",
    "The history of {t} is full of surprising discoveries.", "Many books and films have been made about {t}.",
    "Experts expect big changes around {t} in the next fifty years.",
    "My grandmother used to tell me stories about {t}.",
    "There are many different opinions about {t}.",
    "Last summer I visited a museum that had a whole room about {t}.",
    "Without {t}, daily life would look very different.", "Few people know how {t} and the weather are connected.",
]
# Task kind -> phrasings. Fields: {t} topic, {u} a second topic, {n} a
# count, {lang} a language, {code} a code task, {text} a paragraph, {s} one sentence, {a} {b} numbers.
TASKS: dict[str, list[str]] = {
    "one_word": ["Answer with one word: what color do you associate with {t}?",
                 "In a single word, is {t} mostly about nature, science, history or art?",
                 "Give a one-word answer: what is the main material of {t}?"],
    "yes_no": ["Answer yes or no: did people know about {t} one thousand years ago?",
               "Do people need {t} in everyday life? Reply with yes or no only.",
               "Yes or no: can you find {t} in Antarctica?"],
    "arithmetic": ["What is {a} plus {b}? Answer with the number only.", "Compute {a} times {b}.",
                   "If I have {a} apples and eat {b}, how many are left?"],
    "definition": ["What is {t}? Answer in one sentence.", "Define {t} briefly.", "What does the word '{t}' mean?"],
    "list": ["List {n} facts about {t}.", "Give me {n} words related to {t}, one per line.",
             "Name {n} things people should know about {t}."],
    "story": ["Write a short story about {t}.", "Write a {n}-sentence story that involves {t}.",
              "Write a poem about {t}."],
    "essay": ["Write a detailed essay about {t}.", "Write a long article explaining everything about {t}.",
              "Write a blog post of several paragraphs about {t}."],
    "code": ["Write a Python function that {code}.", "Write a Python class that models {t}.",
             "Write a JavaScript function that {code}."],
    "steps": ["Explain step by step how scientists study {t}.", "Explain {t} to a ten-year-old.",
              "How do I learn about {t}? Give step-by-step instructions."],
    "translate": ["Translate into {lang}: \"{s}\"", "How do you say \"{s}\" in {lang}?"],
    "summary": ["Summarize the following text in one sentence:\n\n{text}",
                "Summarize this text:\n\n{text}", "What is the main idea of this text?\n\n{text}"],
    "compare": ["Compare {t} and {u}.", "What do {t} and {u} have in common?",
                "Which is more useful, {t} or {u}? Explain why."],
}


@dataclass(frozen=True)
class Prompt:
    kind: str
    topic: str
    text: str


def _filled(template: str, topic: str, rng: random.Random) -> str:
    """`template` with its fields drawn (every field is drawn, used or not: the stream of draws
    then depends on the prompt's position alone, not on which template came before)."""
    others = [x for x in TOPICS if x != topic]
    text = " ".join(s.format(t=topic) for s in rng.sample(SENTENCES, rng.randint(2, 8)))
    return template.format(t=topic, u=rng.choice(others), n=rng.randint(2, 12), lang=rng.choice(LANGUAGES),
                           code=rng.choice(CODE_TASKS), text=text, s=rng.choice(SENTENCES).format(t=topic),
                           a=rng.randint(2, 999), b=rng.randint(2, 99))


def make_prompts(count: int, seed: int) -> list[Prompt]:
    """`count` distinct prompts; the kinds in turn (so every kind is equally present), the
    topic and phrasing drawn from `seed`."""
    rng, kinds = random.Random(seed), list(TASKS)
    seen: set[str] = set()
    out: list[Prompt] = []
    for _ in range(count * 50):  # a bound: duplicates are rare but possible
        if len(out) == count:
            break
        kind, topic = kinds[len(out) % len(kinds)], rng.choice(TOPICS)
        text = _filled(rng.choice(TASKS[kind]), topic, rng)
        if text not in seen:
            seen.add(text)
            out.append(Prompt(kind, topic, text))
    if len(out) < count:
        raise ShardlineError(f"could make only {len(out)} distinct prompts of {count}")
    return out


@dataclass
class Answer:
    tokens: int = 0
    finish: str | None = None  # set by the final event


def _collector(answer: Answer, left: list[int], done: threading.Condition) -> Callable[[Event], None]:
    """An engine callback (called on the engine thread) counting one request's tokens."""
    def on_event(ev: Event) -> None:
        if ev.token is not None:
            answer.tokens += 1
            return
        with done:
            answer.finish = ev.finish if ev.finish != "error" else f"error: {ev.error}"
            left[0] -= 1
            done.notify_all()
    return on_event


def measure_lengths(folder: Path, prompts: list[list[int]], max_tokens: int, concurrency: int,
                    time_limit_s: float, run: RunConfig | None = None) -> list[Answer]:
    """Greedy answers to `prompts` through a local engine (every stage in this process, one
    decode group of up to `concurrency` streams). Answers still running at the time limit are
    cancelled: their finish says so."""
    pipe = LocalPipeline(folder, run or RunConfig(precision="exact"))
    engine = Engine(pipe, Limits(concurrency, len(prompts)), load_manifest(folder).arch.max_context,
                    SchedulerConfig(chunk=DEFAULT_PREFILL_CHUNK, groups=1))
    stops = frozenset(ChatTokenizer(folder).stop_ids)
    answers, left, done = [Answer() for _ in prompts], [len(prompts)], threading.Condition()
    tickets: list[Ticket] = []
    try:
        for p, a in zip(prompts, answers, strict=True):
            req = Request(p, SamplingConfig(max_tokens=max_tokens, temperature=0.0, seed=0), stops)
            tickets.append(engine.submit(req, _collector(a, left, done)))
        _wait(done, left, time.monotonic() + time_limit_s, len(prompts))
    finally:
        for t in tickets:
            engine.cancel(t)  # a no-op for those that ended
        engine.stop()
        pipe.shutdown()
    return answers


def _wait(done: threading.Condition, left: list[int], deadline: float, total: int) -> None:
    shown = total
    with done:
        while left[0] and time.monotonic() < deadline:
            done.wait(timeout=min(5.0, max(0.0, deadline - time.monotonic())))
            if shown - left[0] >= 25 or not left[0]:
                shown = left[0]
                print(f"  {total - left[0]}/{total} answered", file=sys.stderr, flush=True)


def encode_features(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")


def decode_features(text: str, size: int) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as e:
        raise ShardlineError(f"features are not base64: {e}") from None
    if len(raw) != 4 * size:
        raise ShardlineError(f"features of {len(raw)} bytes; expected {size} f32")
    v = np.frombuffer(raw, "<f4").astype(np.float32)
    if not np.isfinite(v).all():
        raise ShardlineError("features hold a value that is not finite")
    return v


def write_jsonl_atomic(path: Path, lines: list[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))


def read_dataset(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the records (each with its features decoded to "x"), every field checked."""
    try:
        lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    except (OSError, ValueError) as e:
        raise ShardlineError(f"cannot read the dataset {path}: {e}") from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != FORMAT:
        raise ShardlineError(f"{path} is not a {FORMAT} file (its first line is the header)")
    header = lines[0]
    size, cap = header.get("feature_size"), header.get("max_tokens")
    if type(size) is not int or type(cap) is not int or size < 1 or cap < 1:
        raise ShardlineError(f"{path}: the header needs feature_size and max_tokens >= 1")
    return header, [_record(r, size, cap, n) for n, r in enumerate(lines[1:], 2)]


def _record(r: object, size: int, cap: int, line: int) -> dict[str, Any]:
    if not isinstance(r, dict):
        raise ShardlineError(f"line {line}: not a JSON object")
    length, tokens = r.get("length"), r.get("prompt_tokens")
    if type(length) is not int or type(tokens) is not int or not 0 <= length <= cap or tokens < 1 \
            or r.get("finish") not in ("stop", "length"):
        raise ShardlineError(f"line {line}: a record needs a length in 0-{cap}, prompt_tokens >= 1 and a finish")
    return {**r, "x": decode_features(str(r.get("features")), size)}


def build(folder: Path, count: int, seed: int, max_tokens: int, concurrency: int,
          time_limit_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and one record per prompt answered in time (a cancelled one is left out: its
    length is unknown)."""
    started = time.monotonic()
    prompts = make_prompts(count, seed)
    tok = ChatTokenizer(folder)
    ids = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in prompts]
    extract, manifest = FeatureExtractor(folder), load_manifest(folder)
    features = [extract(x) for x in ids]  # before the engine starts: they would share the cores
    del extract
    print(f"features of {count} prompts in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    answers = measure_lengths(folder, ids, max_tokens, concurrency, time_limit_s - (time.monotonic() - started))
    records = [{"prompt": p.text, "kind": p.kind, "topic": p.topic, "prompt_tokens": len(x), "length": a.tokens,
                "finish": a.finish, "features": encode_features(v)}
               for p, x, a, v in zip(prompts, ids, answers, features, strict=True) if a.finish in ("stop", "length")]
    header = {"format": FORMAT, "version": VERSION, "max_tokens": max_tokens, "seed": seed, "prompts": count,
              "answered": len(records), "model_hash": manifest.model_hash, "features": FEATURE_KIND,
              "stage0_layers": [manifest.stages[0].first_layer, manifest.stages[0].last_layer],
              "feature_size": int(features[0].shape[0]), "chunk": DEFAULT_PREFILL_CHUNK, "precision": "exact",
              "sampling": "greedy", "concurrency": concurrency, "seconds": round(time.monotonic() - started, 1)}
    return header, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardline_tools.lengths.length_data",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=Path, required=True, help="the export folder (the target model)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="seconds for the whole build")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_tokens < 1 or a.concurrency < 1 or a.time_limit <= 0:
        raise ShardlineError("--prompts, --max-tokens, --concurrency and --time-limit must be positive")
    header, records = build(a.shards, a.prompts, a.seed, a.max_tokens, a.concurrency, a.time_limit)
    write_jsonl_atomic(a.out, [header, *records])
    lengths = np.asarray([r["length"] for r in records])
    if len(lengths):
        p = np.percentile(lengths, [10, 25, 50, 75, 90, 99]).round().astype(int).tolist()
        print(f"{len(records)}/{a.prompts} answered in {header['seconds']} s; length p10/25/50/75/90/99 {p}, "
              f"{int((lengths >= a.max_tokens).sum())} at the cap; wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ShardlineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
