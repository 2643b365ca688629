"""Real model files (`shardline pull`) against transformers' fp32 run on their dequantized weights
(tests/golden/real_models.json): Qwen2.5-Coder-0.5B-Instruct (Q4_K_M with Q5_0 and Q8_0), its
tokenizer and chat template, then 8 prompts x 48 greedy tokens through 1 stage, 3 stages and two
workers (their 8 streams in one decode group). The 1.5B (Q4_K_M, 1.1 GB) through 1 stage is
opt-in, outside CI's time: `pytest -m realbig tests/model/test_real_weights.py` (~2.5 min).

Tolerance: at the reference's 32 highest logits of the first and the last step, within 2e-3.
Measured on 2026-12-05 through 1 stage: at most 1.7e-5 (0.5B) and 1.9e-5 (1.5B), f32 on both
sides; the rest is summation order over 24 and 28 layers. The margin is for other CPUs' kernels.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.export.exporter import export
from shardline.export.pull import pull
from shardline.model.catalog import named
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from shardline.serving.scheduler import SchedulerConfig
from tests.helpers import greedy_ours, staggered
from tests.multiproc.procs import worker
from tests.real_models import PROMPTS, STEPS, goldens

NAME = "qwen2.5-coder-0.5b"
BIG = "qwen2.5-coder-1.5b"  # 1.1 GB: opt-in (`pytest -m realbig`), not in CI's time
EXACT = RunConfig(precision="exact", threads=2)
TOLERANCE = 2e-3


def _golden(name: str) -> dict[str, Any]:
    g: dict[str, Any] = goldens()[name]
    assert g["sha256"] == named(name).sha256, "the goldens were made on another file: regenerate them"
    return g


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return _golden(NAME)


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A file pulled (once per cache: CI's is the clone's .cache) and exported per stage count."""
    root = tmp_path_factory.mktemp("real")
    made: dict[tuple[str, int], Path] = {}

    def exported(stages: int, name: str = NAME) -> Path:
        if (name, stages) not in made:
            made[name, stages] = export(ExportConfig(out=root / f"{name}-{stages}", model=pull(named(name)),
                                                     stages=stages, isolate=False, progress=False))
        return made[name, stages]

    return exported


def _check(case: dict[str, Any], tokens: list[int], logits: np.ndarray | None = None) -> None:
    assert tokens == case["tokens"]
    if logits is not None:
        for row, ref in ((logits[0], case["first"]), (logits[-1], case["last"])):
            np.testing.assert_allclose(row[ref["ids"]], ref["values"], rtol=0, atol=TOLERANCE)


def test_the_chat_prompt_is_transformers(real: Callable[..., Path], golden: dict[str, Any]) -> None:
    """The exported tokenizer and the file's chat template give transformers' ids, CJK and emoji too."""
    tok = ChatTokenizer(real(1))
    assert [tok.encode_chat(m) for m in PROMPTS] == [c["ids"] for c in golden["cases"]]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stages"), [(NAME, 1), (NAME, 3), pytest.param(BIG, 1, marks=pytest.mark.realbig)])
def test_greedy_tokens_equal_transformers(name: str, stages: int, real: Callable[..., Path]) -> None:
    with LocalPipeline(real(stages, name), EXACT) as pipe:
        for case in _golden(name)["cases"]:
            _check(case, *greedy_ours(pipe, case["ids"], STEPS, chunk=64))


@pytest.fixture(scope="module")
def remote(real: Callable[..., Path]) -> Iterator[RemotePipeline]:
    ws = [worker(real(3), "1"), worker(real(3), "2")]
    try:
        pipe = RemotePipeline(real(3), [w.addr for w in ws], EXACT, activations="f32")
        yield pipe
        pipe.shutdown()
    finally:
        for w in ws:
            w.stop()


@pytest.mark.slow
def test_two_workers_in_one_decode_group_equal_transformers(remote: RemotePipeline, golden: dict[str, Any]) -> None:
    """All 8 streams through stage 0 here and two worker processes, joining one decode group."""
    engine = Engine(remote, Limits(8, 8), 8192, SchedulerConfig(groups=1))
    try:
        got = staggered(engine, [c["ids"] for c in golden["cases"]], [STEPS] * len(PROMPTS))
    finally:
        engine.stop()
    for case, tokens in zip(golden["cases"], got, strict=True):
        _check(case, tokens)


@pytest.mark.slow
def test_the_golden_is_transformers(golden: dict[str, Any]) -> None:
    """The first prompt's golden re-derived with transformers' GGUF loader (fp32) on the pulled file."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.model.reference import greedy_reference

    path = pull(named(NAME))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    case = golden["cases"][0]
    assert greedy_reference(model, case["ids"], STEPS)[0] == case["tokens"]


TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}]
TOOL_CHAT: Any = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
]


def test_its_own_template_renders_tools_as_transformers_does(real: Callable[..., Path]) -> None:
    """Qwen2.5's template, run by us, renders tools, a call and its result as transformers renders
    them; it teaches Hermes calls, `<tool_call>` being one token of its vocabulary (issue 40)."""
    from transformers import AutoTokenizer

    from shardline.model.tool_calls import Hermes

    path = pull(named(NAME))
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = ChatTokenizer(real(1))
    for messages in (TOOL_CHAT[:1], TOOL_CHAT):
        assert tok.chat_prompt(messages, tools=TOOLS) == hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert isinstance(tok.tool_syntax, Hermes) and tok.tokens("<tool_call>") == [151657]


def test_a_required_call_is_valid_on_the_real_model(real: Callable[..., Path]) -> None:
    import json

    import jsonschema

    from shardline.config import SamplingConfig
    from shardline.model.grammar import Grammars, GrammarSpec
    from shardline.model.manifest import load_manifest
    from shardline.model.tool_calls import MARKERS
    from shardline.serving.engine import Request
    from tests.serving.test_constrained import _run

    folder = real(1)
    tok = ChatTokenizer(folder)
    grammars = Grammars((folder / "tokenizer.json").read_text(), load_manifest(folder).arch.vocab, tok.stop_ids)
    assert tok.tool_syntax is not None
    syntax = type(tok.tool_syntax)(grammars.special(MARKERS))  # as api/tools.py builds it
    tools = [t["function"] for t in TOOLS]
    prompt = tok.encode_chat(TOOL_CHAT[:1], tools=TOOLS)
    spec = GrammarSpec("lark", syntax.grammar(tools, False))
    with LocalPipeline(folder, EXACT) as pipe:
        engine = Engine(pipe, Limits(2, 2), 8192)
        try:  # required, and auto (if the model calls on its own, its call is held to the schema)
            out = _run(engine, [Request(prompt, SamplingConfig(max_tokens=60), frozenset(tok.stop_ids),
                                        constraint=c) for c in (grammars.constraint(spec),
                                                                grammars.lazy(spec, syntax.trigger))])
        finally:
            engine.stop()
    calls = [syntax.parse(tok.raw.decode(got, skip_special_tokens=False)).calls for got, _ in out]
    assert [f for _, f in out] == ["stop", "stop"] and len(calls[0]) == 1  # required: exactly one call
    for call in calls[0] + calls[1]:  # auto: this model answers in a fenced JSON block, which is its choice
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), tools[0]["parameters"])


FAST_GOLDEN = Path(__file__).parents[1] / "golden" / "fast.json"
NEAR_TIE = 0.1  # a runner-up within this many nats of the top: two int8 roundings may part there
# nats: the chosen token's log-probability against llama.cpp's, at the median and at worst.
# Measured 2026-12-07: fast 0.0015 and 0.173, exact 0.0018 and 0.176 (exact parts from llama.cpp
# as much as fast does: the worst steps are llama.cpp's own f16 cache and summation order).
FAST_LOGPROB_MEDIAN, FAST_LOGPROB_MAX = 0.005, 0.25


@pytest.mark.slow
def test_fast_follows_llama_cpp_on_the_quantized_file(real: Callable[..., Path]) -> None:
    """`--precision fast` runs the file's blocks with int8 activations, as llama.cpp's CPU kernels
    do: its greedy tokens are llama.cpp's (tests/golden/fast.json, llama-server on the very file)
    up to the first near-tie, and the agreed tokens' log-probabilities are llama.cpp's (median
    and worst bounds). The two quantize activations alike but for the f16 rounding of llama.cpp's
    per-block scales for Q8_0."""
    golden = json.loads(FAST_GOLDEN.read_text())
    assert golden["sha256"] == named(NAME).sha256, "the golden was made on another file: regenerate it"
    agreed, diffs = 0, []
    with LocalPipeline(real(1), RunConfig(precision="fast", threads=2)) as pipe:
        for case in golden["cases"]:
            tokens, logits = greedy_ours(pipe, case["ids"], len(case["tokens"]), chunk=64)
            logprobs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - logits.max(1, keepdims=True)
            for step, (ours, theirs) in enumerate(zip(tokens, case["tokens"], strict=True)):
                if ours != theirs:
                    assert case["margins"][step] < NEAR_TIE, f"parted at step {step} with a margin of " \
                                                             f"{case['margins'][step]:.3f}"
                    break
                agreed += 1
                diffs.append(abs(float(logprobs[step, ours]) - case["logprobs"][step]))
    assert agreed >= 0.75 * sum(len(c["tokens"]) for c in golden["cases"])
    assert float(np.median(diffs)) < FAST_LOGPROB_MEDIAN and max(diffs) < FAST_LOGPROB_MAX
