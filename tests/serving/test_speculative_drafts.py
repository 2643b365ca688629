"""Draft models on the coordinator: self-speculation (the target's first layers, exported as a
shard of their own) and a tiny draft/target pair of different sizes. Greedy output equals plain
greedy output token for token; with temperature > 0 the drafts are drawn from the draft's own
distribution and verified by min(1, p/q) / residual at the last stage, and what comes out is
distributed as the target's own sampling (a chi-square test on the tiny pair)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from shardline.config import ExportConfig, RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.manifest import MANIFEST, load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts, SpecStats
from shardline.stage.draft_model import DraftModel
from tests.helpers import engine_tokens, staggered

LONG = 200
TEXT = "Explain in three sentences how a bicycle works, then list its main parts."


@pytest.fixture(scope="module")
def first6(two: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Self-speculation's draft: the default model's first 6 layers, norm and head, one stage."""
    return export(ExportConfig(out=tmp_path_factory.mktemp("self") / "first6", stages=1, weights="gguf", truncate=6,
                               isolate=False, progress=False))


def _stats(engine: Engine, prompt: list[int], cfg: SamplingConfig) -> tuple[list[int], SpecStats | None]:
    got: list[int] = []
    final: list[Event] = []
    done = threading.Event()

    def on(ev: Event) -> None:
        if ev.token is None:
            final.append(ev)
            done.set()
        else:
            got.append(ev.token)

    engine.submit(Request(prompt, cfg, frozenset()), on)
    assert done.wait(300)
    assert final[0].finish == "length", final[0]
    return got, final[0].spec


@pytest.mark.slow
def test_self_speculation_greedy_equals_plain(two: Path, first6: Path, pipe: LocalPipeline) -> None:
    prompt = ChatTokenizer(two).encode_chat([{"role": "user", "content": TEXT}])
    want = engine_tokens(pipe, prompt, SamplingConfig(max_tokens=LONG), groups=0)
    draft = DraftModel(first6, load_manifest(two))
    engine = Engine(pipe, Limits(2, 2), 8192, SchedulerConfig(groups=0, compact_at=16), Drafts(draft.drafter, 3, 8))
    try:
        got, stats = _stats(engine, prompt, SamplingConfig(max_tokens=LONG))
    finally:
        engine.stop()
    assert got == want
    assert stats is not None and stats.drafted > 0 and 0 < stats.accepted <= stats.drafted
    assert not draft.runner.keys()  # the stream's draft request was closed with it
    engine = Engine(pipe, Limits(2, 2), 8192, SchedulerConfig(groups=1, compact_at=16), Drafts(draft.drafter, 2, 8))
    try:
        assert staggered(engine, [prompt, prompt], [LONG, 120]) == [want, want[:120]]
    finally:
        engine.stop()


def test_a_tiny_draft_of_another_size_inside_a_group(tiny_models: tuple[Path, Path]) -> None:
    target, draft_folder = tiny_models
    tok = ChatTokenizer(target)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in ("Hello there!", "Count to ten.")]
    with LocalPipeline(target) as pipe:
        plain = [engine_tokens(pipe, p, SamplingConfig(max_tokens=120), groups=0) for p in prompts]
        draft = DraftModel(draft_folder, load_manifest(target))
        engine = Engine(pipe, Limits(4, 4), 8192, SchedulerConfig(groups=1, compact_at=8),
                        Drafts(draft.drafter, None, 6))
        try:
            got = staggered(engine, [prompts[0], prompts[1], prompts[0]], [120, 80, 50])
        finally:
            engine.stop()
    assert got == [plain[0], plain[1][:80], plain[0][:50]]


def test_an_exact_targets_draft_runs_fast(tiny_models: tuple[Path, Path]) -> None:
    """Its proposals are verified: the draft of an `exact` target takes `fast` (f16 KV), and a
    target already fast keeps its own KV choice for the draft too."""
    target, draft_folder = tiny_models
    assert DraftModel(draft_folder, load_manifest(target), RunConfig(precision="exact")).runner.kv_precision == "f16"
    fast = RunConfig(precision="fast", kv_precision="u8")
    assert DraftModel(draft_folder, load_manifest(target), fast).runner.kv_precision == "u8"


def test_a_draft_with_another_tokenizer_is_refused(two: Path, tiny_models: tuple[Path, Path], tmp_path: Path) -> None:
    """A well-formed export whose tokenizer differs (same vocabulary size) cannot draft."""
    other = tmp_path / "other"
    shutil.copytree(tiny_models[1], other)
    tok = other / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["files"]["tokenizer.json"] = hashlib.sha256(tok.read_bytes()).hexdigest()
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardlineError, match="does not share the target's tokenizer"):
        DraftModel(other, load_manifest(tiny_models[0]))


def test_a_draft_export_of_several_stages_or_a_wrong_path_is_refused(two: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardlineError, match="has 2 stages; export it as one"):
        DraftModel(two, load_manifest(two))
    with pytest.raises(ShardlineError, match="draft model: "):
        DraftModel(tmp_path / "nowhere", load_manifest(two))


RUNS = 300


@pytest.mark.slow
def test_sampled_drafts_keep_the_targets_distribution(tiny_models: tuple[Path, Path]) -> None:
    """The 2nd and 3rd tokens of many seeded requests at temperature 1, top-k 4: with drafts
    drawn from the tiny draft (K = 2 after the first token, verified at the last stage) and without; the two samples
    of (2nd, 3rd) token pairs must not differ (chi-square, two samples). The draft is far from
    the target here, so a wrong rule (e.g. greedy acceptance of sampled drafts) would show."""
    target, draft_folder = tiny_models
    prompt = ChatTokenizer(target).encode_chat([{"role": "user", "content": "Hello there!"}])
    draft = DraftModel(draft_folder, load_manifest(target))
    samples: dict[str, list[tuple[int, int]]] = {}
    with LocalPipeline(target) as pipe:
        for name, drafts in [("plain", None), ("speculative", Drafts(draft.drafter, 2, 2))]:
            engine = Engine(pipe, Limits(4, RUNS), 8192, SchedulerConfig(groups=0), drafts)
            try:
                out = [_stats(engine, prompt, SamplingConfig(max_tokens=4, temperature=1.0, top_k=4, seed=s))
                       for s in range(RUNS)]
            finally:
                engine.stop()
            samples[name] = [(t[1], t[2]) for t, _ in out]
            if drafts is not None:
                assert sum(st.drafted for _, st in out if st) >= 2 * RUNS  # the verify rule was used
    pairs = sorted(set(samples["plain"]) | set(samples["speculative"]))
    table = np.array([[samples[n].count(p) for p in pairs] for n in ("plain", "speculative")])
    common = table.sum(axis=0) >= 5  # rare pairs pooled, as the test needs expected counts >= ~5
    table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    table = table[:, table.sum(axis=0) > 0]
    assert chi2_contingency(table).pvalue > 1e-3
