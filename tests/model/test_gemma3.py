"""Gemma 3 (text) from a hand-built GGUF file (issue 37, points 2, 3 and 6): seven layers, five
local ones (a 16-token sliding window, rotary base 10000, no scaling) around a global sixth
(rotary base 1e6 with linear scaling 8, as Gemma 3 4B+), embeddings times sqrt(hidden), norms
before and after attention and the MLP, q/k norms, GELU (tanh) gating, Gemma's SentencePiece
vocabulary. The prompt (40 tokens) is longer than the window, so local layers forget.

The file, exported as stored (Q8_0 blocks kept), gives transformers' greedy tokens and logits
(its GGUF loader, on the same file) at 1 and 3 stages, and the same tokens on every other path a
window must hold on: static stages, decode groups, speculation with compaction, prefix reuse, and
a KV transfer. llama.cpp (tests/golden/families.json, llama-server on the f32 copy) agrees to
1e-4 and token for token once its GELU is computed; stock, its CPU kernel looks GELU up in an
fp16 table (ggml-cpu/vec.h, GGML_GELU_FP16), and agrees within that table's error.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.gguf_source import GGUFSource
from shardline.pipeline.kv import handoff
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import decode, export_kv, import_kv, prefill, run
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine, Request, Serving
from shardline.serving.prefix import PrefixCache
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.cache import KVBook
from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.gguf_vocab import gemma_vocab
from tests.ggufs import FileSpec, file_sha256
from tests.golden.families_llama_server import EXACT_GELU, GOLDEN
from tests.helpers import GREEDY, engine_tokens, greedy_ours, ok, staggered

EXACT = RunConfig(precision="exact", threads=2)
WINDOW = 16
# Untied (Gemma ties its head): with a tied one these random weights repeat one token, and
# varied tokens make the comparison sharper; a tied file is read in test_a_tied_file_*.
CASE = Case(FileSpec(name="gemma3-Q8_0", arch="gemma3", weights="Q8_0", layers=7, qk_norms=True, post_norms=True,
                     rms_eps=1e-6, rope_theta=1e6, vocab=gemma_vocab(),
                     extra_keys={"{arch}.attention.sliding_window": WINDOW, "{arch}.rope.scaling.type": "linear",
                                 "{arch}.rope.scaling.factor": 8.0}), prompt_len=40)
TOLERANCE = 1e-4
# llama.cpp's GELU is an fp16 table lookup: its log-probabilities stray this far from exact.
LLAMA_CPP_GELU = 2e-2
OTHER = [(7 + 13 * i) % 700 + 3 for i in range(37)]  # a second prompt past the window


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CASE.write(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def folders(gemma3: Path) -> dict[str, Path]:
    root = gemma3.parent
    cfgs = {"1": {"stages": 1}, "3": {"stages": 3}, "static": {"stages": 2, "static": frozenset({0, 1})}}
    return {k: export(ExportConfig(out=root / f"shards-{k}", model=gemma3, isolate=False, progress=False, **kw))
            for k, kw in cfgs.items()}


def _transformers(path: Path, window: int) -> object:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' GGUF config reader takes neither the head size nor the query scale nor the
    # rotary scaling from the file (Gemma3TextConfig's defaults stay): they are given here; the
    # tensors are still read and dequantized by it (its Gemma loader takes 1 off every norm).
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.head_dim = config.query_pre_attn_scalar = CASE.spec.head_dim
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    config.sliding_window = window
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference(gemma3: Path) -> tuple[list[int], np.ndarray]:
    from tests.model.reference import greedy_reference

    return greedy_reference(_transformers(gemma3, WINDOW), CASE.prompt(), STEPS)


@pytest.fixture(scope="module")
def plain(folders: dict[str, Path]) -> list[list[int]]:
    with LocalPipeline(folders["1"], EXACT) as pipe:
        return [greedy_ours(pipe, p, STEPS)[0] for p in (CASE.prompt(), OTHER)]


def test_the_file_reads_as_gemma3_with_local_and_global_layers(gemma3: Path) -> None:
    arch = GGUFSource(gemma3).arch
    assert (arch.family, arch.sliding_window, arch.local_layers, arch.max_context) == ("gemma3", 16,
                                                                                        (0, 1, 2, 3, 4, 6), 4096)
    assert [arch.window(i) for i in (0, 5, 6)] == [16, None, 16]
    assert arch.rotary(0) == (10000.0, None, False) and arch.rotary(5) == (1e6, 8.0, True)
    assert arch.query_scale == pytest.approx(1 / 8) and arch.tied_embeddings is False
    assert "model.layers.3.mlp.post_norm.weight" in arch.layer_tensors(3)


@pytest.mark.parametrize("stages", ["1", "3"])
def test_greedy_tokens_and_logits_equal_transformers(stages: str, folders: dict[str, Path],
                                                     reference: tuple[list[int], np.ndarray]) -> None:
    with LocalPipeline(folders[stages], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == reference[0]
    np.testing.assert_allclose(logits, reference[1], rtol=0, atol=TOLERANCE)


def test_the_window_changes_the_answer(gemma3: Path, reference: tuple[list[int], np.ndarray]) -> None:
    """Without its window (one as long as the context) the same weights answer otherwise: the
    tests above would catch a window ignored."""
    from tests.model.reference import greedy_reference

    unwindowed = greedy_reference(_transformers(gemma3, CASE.spec.context), CASE.prompt(), STEPS)
    assert unwindowed[0] != reference[0]


def test_static_stages_give_the_stateful_tokens(folders: dict[str, Path], plain: list[list[int]]) -> None:
    with LocalPipeline(folders["static"], EXACT) as pipe:
        assert greedy_ours(pipe, CASE.prompt(), STEPS, chunk=7)[0] == plain[0]


def test_decode_groups_and_speculation_give_the_plain_tokens(folders: dict[str, Path],
                                                             plain: list[list[int]]) -> None:
    with LocalPipeline(folders["3"], EXACT) as pipe:
        engine = Engine(pipe, Limits(4, 4), 4096, SchedulerConfig(chunk=9, groups=1))
        try:
            assert staggered(engine, [CASE.prompt(), OTHER], [STEPS, STEPS]) == plain
        finally:
            engine.stop()
        drafts = Drafts(LookupDrafter, None, 8)
        for prompt, tokens in zip((CASE.prompt(), OTHER), plain, strict=True):
            assert engine_tokens(pipe, prompt, SamplingConfig(max_tokens=STEPS), drafts=drafts, groups=0,
                                 compact_at=8) == tokens


def _ask(engine: Engine | Serving, prompt: list[int]) -> list[int]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(prompt, SamplingConfig(max_tokens=STEPS), frozenset()), events.put)
    out = []
    while (ev := events.get(timeout=300)).token is not None:
        out.append(ev.token)
    assert ev.finish == "length", ev.error
    return out


def test_a_prompt_reusing_a_kept_prefix_gives_the_cold_tokens(folders: dict[str, Path]) -> None:
    """The second prompt starts with the first: it starts from the kept KV past the window."""
    second = CASE.prompt() + OTHER[:9]
    with LocalPipeline(folders["1"], EXACT) as pipe:
        cold = greedy_ours(pipe, second, STEPS)[0]
        cache = PrefixCache(64 << 20, sum(s.slot_bytes for s in pipe.layout()))
        engine = Engine(pipe, Limits(2, 2), 4096, SchedulerConfig(chunk=16, groups=1), prefix=cache)
        try:
            _ask(engine, CASE.prompt())
            assert _ask(engine, second) == cold
            assert cache.stats.hits == 1
        finally:
            engine.stop()


def test_a_stream_moved_to_another_pipeline_decodes_the_same_tokens(folders: dict[str, Path],
                                                                    plain: list[list[int]]) -> None:
    """KV export and import (disaggregated serving's move) past the window."""
    with LocalPipeline(folders["3"], EXACT) as a, LocalPipeline(folders["3"], EXACT) as b:
        book = KVBook()
        (out,) = ok(run(a, prefill(1, book, CASE.prompt(), GREEDY, first=True, last=True)))
        moved = handoff(export_kv(a, 1).result(60), book)
        import_kv(b, 2, moved.kv).result(60)
        tokens, on_b = [out.choices[0].token], moved.book()
        for _ in range(STEPS - 1):
            (out,) = ok(run(b, decode(2, on_b, [tokens[-1]], GREEDY)))
            tokens.append(out.choices[0].token)
        a.release(1)
        b.release(2)
    assert tokens == plain[0]


def test_disaggregated_serving_gives_the_plain_tokens(folders: dict[str, Path], plain: list[list[int]]) -> None:
    """TetriInfer's split: each prompt prefilled on one instance, its KV moved to a decode
    instance that decodes past the window."""
    from shardline.disagg.decode import decode_instance
    from shardline.disagg.front import Disaggregated, FrontConfig
    from shardline.disagg.instance import Admission
    from shardline.disagg.prefill import oracle_predict, prefill_instance

    with LocalPipeline(folders["3"], EXACT) as p, LocalPipeline(folders["3"], EXACT) as d:
        front = Disaggregated(FrontConfig(heavy_from=64, period_s=0.02))
        prefill = prefill_instance(p, Limits(4, 8), 4096, 16, front.dispatch, oracle_predict(64, 8))
        decode_ = decode_instance(d, Limits(4, 8), 4096, SchedulerConfig(chunk=16, groups=1),
                                  Admission.RESERVE_DYNAMIC, 4 * 4096, 64)
        front.start({"prefill-0": prefill}, {"decode-0": decode_})
        try:
            got = [_ask(front, prompt) for prompt in (CASE.prompt(), OTHER)]
        finally:
            front.stop()
    assert got == plain


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row - row.max()
    return row - np.log(np.exp(row).sum())  # as llama-server gives log-probabilities


def _golden(gemma3: Path, name: str) -> dict:  # type: ignore[type-arg]
    golden = json.loads(GOLDEN.read_text())["files"][name]
    assert file_sha256(gemma3) == golden["sha256"], "the file changed: regenerate tests/golden/families.json"
    return golden  # type: ignore[no-any-return]


def test_greedy_tokens_and_log_probabilities_equal_llama_cpps_with_exact_gelu(gemma3: Path,
                                                                               folders: dict[str, Path]) -> None:
    """llama.cpp with its GELU computed rather than looked up: 32 identical tokens past the
    window, every log-probability within 1e-4."""
    golden = _golden(gemma3, CASE.name + EXACT_GELU)
    with LocalPipeline(folders["3"], EXACT) as pipe:
        tokens, logits = greedy_ours(pipe, CASE.prompt(), STEPS)
    assert tokens == golden["tokens"]
    # llama-server gives no probabilities for a step whose token ends mid-character (one here)
    kept = [s for s in LOGIT_STEPS if str(s) in golden["logprobs"]]
    assert len(kept) >= 3
    for step in kept:
        np.testing.assert_allclose(_log_softmax(logits[step]), golden["logprobs"][str(step)], rtol=0, atol=TOLERANCE)


def test_stock_llama_cpps_path_is_ours_within_its_gelu_table(gemma3: Path, folders: dict[str, Path]) -> None:
    """The stock llama.cpp (an fp16 GELU table) leaves our greedy path where two tokens are
    within its error: fed its tokens, ours ranks each of them within LLAMA_CPP_GELU of the best,
    and agrees with its log-probabilities that far (at the kept steps it returned)."""
    golden = _golden(gemma3, CASE.name)
    rows = []
    with LocalPipeline(folders["1"], EXACT) as pipe:
        key, book = 11, KVBook()
        (out,) = ok(run(pipe, prefill(key, book, CASE.prompt(), GREEDY, first=True, last=True, want_logits=True)))
        for token in golden["tokens"]:
            rows.append(_log_softmax(np.asarray(out.choices[0].logits)))
            (out,) = ok(run(pipe, decode(key, book, [token], GREEDY, want_logits=True)))
        pipe.release(key)
    for row, token in zip(rows, golden["tokens"], strict=True):
        assert row[token] >= row.max() - LLAMA_CPP_GELU
    assert len(golden["logprobs"]) >= 3  # step 31 is a byte token there: llama-server gives no row
    for step, theirs in golden["logprobs"].items():
        np.testing.assert_allclose(rows[int(step)], theirs, rtol=0, atol=LLAMA_CPP_GELU)


def test_a_tied_file_reads_its_head_from_the_embedding(tmp_path: Path) -> None:
    path = Case(CASE.spec.with_(name="gemma3-tied", tied=True, layers=2)).write(tmp_path)
    source = GGUFSource(path)
    assert source.arch.tied_embeddings and not source.has("lm_head.weight")


@pytest.fixture
def bad(tmp_path: Path) -> Iterator[Callable[..., None]]:
    def refused(match: str, **changes: object) -> None:
        spec = CASE.spec.with_(name="gemma3-bad", layers=2, **changes)
        path = Case(spec).write(tmp_path)
        out = tmp_path / "shards"
        with pytest.raises(ShardlineError, match=match):
            export(ExportConfig(out=out, model=path, stages=1, isolate=False, progress=False))
        assert not out.exists()
        path.unlink()
    yield refused


@pytest.mark.parametrize("keys, match", [
    ({"{arch}.attention.sliding_window_pattern": "every 6"}, "sliding_window_pattern 'every 6' is not a layer pattern"),
    ({"{arch}.attention.sliding_window": "wide"}, "sliding_window 'wide' is not a window of tokens"),
    ({"{arch}.rope.freq_base_swa": "ten thousand"}, "freq_base_swa is not a number"),
    ({"{arch}.rope.freq_base_swa": -1.0}, "freq_base_swa -1.0 is not a rotary base"),
    ({"{arch}.rope.scaling.type": "yarn"}, "rope scaling 'yarn' is not supported"),
    ({"{arch}.final_logit_softcapping": -30.0}, "final_logit_softcapping -30.0 is negative"),
], ids=["pattern", "window", "local-base", "local-base-negative", "rotary-kind", "softcap"])
def test_a_file_with_keys_the_family_does_not_know_is_refused(keys: dict[str, object], match: str,
                                                              bad: Callable[..., None]) -> None:
    bad(match, extra_keys=CASE.spec.extra_keys | keys)


def test_a_file_without_its_norms_or_with_rope_freqs_is_refused(bad: Callable[..., None]) -> None:
    bad("attn_q_norm", qk_norms=False)
    bad("post_attention_norm", post_norms=False)
    bad("rope_freqs factors with local", rope_freqs=True)


def test_gemmas_chat_renders_with_its_turn_markers_and_one_bos(folders: dict[str, Path]) -> None:
    """Gemma's template (a system message folded into the first user turn, the assistant as
    "model") through the exported SentencePiece tokenizer: its BOS once though both the template
    and add_bos ask for it, the turn markers as their control tokens, no space prefix."""
    from shardline.model.tokenizer import ChatTokenizer

    ids = ChatTokenizer(folders["1"]).encode_chat([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hello world"}])
    pieces = [CASE.spec.vocab.tokens[i] for i in ids]
    assert pieces[:6] == ["<s>", "<start_of_turn>", "u", "s", "er", "<0x0A>"]
    assert pieces.count("<s>") == 1 and pieces.count("<start_of_turn>") == 2 and pieces.count("<end_of_turn>") == 1
    assert pieces[-6:] == ["<start_of_turn>", "m", "o", "de", "l", "<0x0A>"]


def test_attention_sinks_with_windowed_layers_are_refused(gemma3: Path, tmp_path: Path) -> None:
    """A sliding static cache forgets slots, so positions stop being the count of attended slots
    that windowed layers' masks rely on: refused before anything is written."""
    out = tmp_path / "sinks"
    with pytest.raises(ShardlineError, match="--sinks with a model whose layers have sliding windows \\(16 tokens\\)"):
        export(ExportConfig(out=out, model=gemma3, stages=1, static=frozenset({0}), context=64, sinks=4,
                            isolate=False, progress=False))
    assert not out.exists()


def test_a_paged_stage_keeps_the_windows(gemma3: Path, plain: list[list[int]]) -> None:
    """Issue 41: Gemma 3 built paged (export/paged.py: each local layer's window given to its
    PagedAttention node) gives the stateful tokens for a prompt longer than the window, with
    decode tokens and the other prompt's chunk riding in one call."""
    from shardline.export.graph import build_stage
    from shardline.export.plan import even_split
    from shardline.export.weights import Weights
    from shardline.stage.paged_batch import PagedBatch
    from shardline.stage.paged_runner import PagedRunner

    source = GGUFSource(gemma3)
    weights = Weights(source, "gguf")
    graph = build_stage(source.arch, even_split(source.arch.n_layers, 1)[0], weights, paged=True)
    runner = PagedRunner(graph, "CPU", EXACT.ov_properties(), 8, vocab=source.arch.vocab)
    a, b = CASE.prompt(), OTHER
    logits = runner.run(PagedBatch.of([(len(a), 0, [0, 1])], [len(a) - 1]), np.asarray(a, np.int64))
    mine_a, mine_b = [int(logits[0].argmax())], []
    for i in range(STEPS - 1):  # A decodes; B's prompt comes in the first call, then B decodes beside A
        past_a = len(a) + i
        table_a = [0, 1, 2][: -(-(past_a + 1) // 32)]
        if i == 0:
            batch = PagedBatch.of([(1, past_a, table_a), (len(b), 0, [3, 4])], [0, len(b)])
            ids = [mine_a[-1], *b]
        else:
            past_b = len(b) + i - 1
            batch = PagedBatch.of([(1, past_a, table_a), (1, past_b, [3, 4, 5][: -(-(past_b + 1) // 32)])], [0, 1])
            ids = [mine_a[-1], mine_b[-1]]
        logits = runner.run(batch, np.asarray(ids, np.int64))
        mine_a.append(int(logits[0].argmax()))
        mine_b.append(int(logits[1].argmax()))
    assert mine_a == plain[0]
    assert mine_b == plain[1][: len(mine_b)]
