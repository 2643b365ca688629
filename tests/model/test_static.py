"""Static stages (issue 25): `export --static` writes graphs of fixed shapes with no state, the
KV kept on the host in a ring (stage/static_runner.py). Within the ring their greedy tokens are
the stateful stages' token for token: 1 and 2 stages, prompts in chunks through the prefill
graph, speculation, and a pipeline that mixes a stateful stage 0 with a static stage 1. What
does not fit is refused with a clear error."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from shardline.cli import static_stages
from shardline.config import ExportConfig, RunConfig, SamplingConfig, SamplingParams, ServeConfig, SpeculationConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.export.exporter import export
from shardline.model.manifest import MANIFEST, load_manifest
from shardline.model.shapes import dynamic
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import prefill, run
from shardline.server import scheduling
from shardline.serving.admission import Limits
from shardline.serving.drafters import LOOKUP_PRIOR, LookupDrafter
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.generate import generate
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.cache import KVBook, StepInputs
from shardline.stage.draft_model import DraftModel
from tests.conftest import CHAT_PROMPTS
from tests.helpers import engine_tokens

RING, WIDTH = 160, 16
SMALL_RING, SINKS = 64, 4
EXACT = RunConfig(precision="exact")
GREEDY_24 = SamplingConfig(max_tokens=24)


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """static(kind) -> an export of the default model: "1" and "2" stages all static with a
    prefill graph, "mixed": 2 stages, stage 1 static without one, "sinks": 1 static stage that
    slides past a small ring, "paged": 3 stages, stage 1 static (with a prefill graph) between
    paged ones."""
    root, made = tmp_path_factory.mktemp("static"), dict[str, Path]()
    how = {"1": dict(stages=1, static=frozenset({0}), prefill_chunk=WIDTH),
           "2": dict(stages=2, static=frozenset({0, 1}), prefill_chunk=WIDTH),
           "mixed": dict(stages=2, static=frozenset({1})),
           "sinks": dict(stages=1, static=frozenset({0}), prefill_chunk=WIDTH, sinks=SINKS),
           "paged": dict(stages=3, static=frozenset({1}), prefill_chunk=WIDTH, paged=True)}

    def get(kind: str) -> Path:
        if kind not in made:
            ring = SMALL_RING if kind == "sinks" else RING
            made[kind] = export(ExportConfig(out=root / kind, weights="gguf", context=ring, isolate=False,
                                             progress=False, **how[kind]))  # type: ignore[arg-type]
        return made[kind]

    return get


@pytest.fixture(scope="module")
def prompts(shards: Callable[..., Path]) -> list[list[int]]:
    tok = ChatTokenizer(shards("gguf", stages=1))
    out = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:2]]
    assert all(WIDTH < len(p) < RING - GREEDY_24.max_tokens for p in out)  # several chunks, inside the ring
    return out


def _tokens(folder: Path, prompts: list[list[int]], drafts: Drafts | None = None) -> list[list[int]]:
    with LocalPipeline(folder, EXACT) as pipe:
        return [engine_tokens(pipe, p, GREEDY_24, chunk=WIDTH, drafts=drafts, groups=0) for p in prompts]


def test_a_static_export_has_fixed_shapes_and_says_which_stage_is_which(static: Callable[[str], Path]) -> None:
    m = load_manifest(static("mixed"))
    assert [(e.runner, e.ring, e.prefill_xml) for e in m.stages] == [("stateful", None, None), ("static", RING, None)]
    two = load_manifest(static("2"))
    assert all(e.runner == "static" and e.ring == RING and e.prefill_width == WIDTH for e in two.stages)
    for e in two.stages:
        assert e.prefill_xml and e.files == [e.xml, e.bin, e.prefill_xml, e.prefill_bin]
        assert all(None not in p.shape for p in e.inputs + e.outputs)
        assert dynamic(ov.Core().read_model(static("2") / e.prefill_xml)) == []
        kv = next(p for p in e.outputs if p.name.startswith("present."))
        assert kv.shape[2] == 1  # the decode graph takes out only the new token's KV
    assert m.arch.max_context == RING and m.format_version == 4


@pytest.mark.parametrize("weights, element", [("int8", "u8"), ("int4", "i4")])
def test_compressed_static_stages_keep_fixed_shapes_and_give_the_stateful_tokens(
        shards: Callable[..., Path], prompts: list[list[int]], tmp_path: Path, weights: str, element: str) -> None:
    """NNCF compresses the static graphs too (decode and prefill), every shape stays fixed after
    it, and the tokens are those of the stateful stage with the same weights."""
    folder = export(ExportConfig(out=tmp_path / weights, weights=weights, stages=1, static=frozenset({0}),
                                 prefill_chunk=WIDTH, context=RING, isolate=False, progress=False))
    (entry,) = load_manifest(folder).stages
    assert entry.runner == "static" and entry.prefill_xml is not None
    for xml in (entry.xml, entry.prefill_xml):
        model = ov.Core().read_model(folder / xml)
        assert dynamic(model) == []
        kinds = {op.get_output_element_type(0).get_type_name() for op in model.get_ordered_ops()
                 if op.get_type_name() == "Constant"}
        assert element in kinds, kinds  # compressed, not left in floats
    assert _tokens(folder, prompts[:1]) == _tokens(shards(weights, stages=1), prompts[:1])


@pytest.mark.parametrize("kind, stages", [("1", 1), ("2", 2), ("mixed", 2)])
def test_static_stages_give_the_stateful_tokens(static: Callable[[str], Path], shards: Callable[..., Path],
                                                prompts: list[list[int]], kind: str, stages: int) -> None:
    stateful = _tokens(shards("gguf", stages=stages), prompts)
    assert _tokens(static(kind), prompts) == stateful


def test_a_static_stage_between_paged_ones_gives_the_stateful_tokens(static: Callable[[str], Path],
                                                                      shards: Callable[..., Path],
                                                                      prompts: list[list[int]]) -> None:
    """Issue 56: an NPU's static stage behind the paged runner's interface (stage/static_blocks.py),
    between two paged stages in one paged pipeline: its KV on host blocks of the paged stages'
    size, each sequence of a fused step run on a ring gathered from its blocks. Two streams at
    once, prompts in chunks no wider than its prefill graph (the scheduler keeps to its limits),
    then prompt-lookup drafts verified through it: the stateful tokens, every block back."""
    from shardline.pipeline.paged_local import PagedPipeline
    from shardline.server import paged_scheduling
    from shardline.serving.kv_blocks import BlockPool
    from shardline.serving.paged_scheduler import PagedScheduler
    from shardline.stage.paged_runner import PagedRunner
    from shardline.stage.static_blocks import StaticBlocks

    folder = static("paged")
    m = load_manifest(folder)
    assert [e.runner for e in m.stages] == ["paged", "static", "paged"] and m.arch.max_context == RING
    repeat = prompts[0] + prompts[0][-12:]
    stateful = _tokens(shards("gguf", stages=2), [*prompts, repeat])
    for drafts in (None, Drafts(LookupDrafter, 4, 8, LOOKUP_PRIOR)):
        pipe = PagedPipeline(folder, EXACT, 64 << 20)
        assert [type(s) for s in pipe.stages] == [PagedRunner, StaticBlocks, PagedRunner]
        sched = PagedScheduler(paged_scheduling(ServeConfig(), m, pipe), BlockPool(pipe.blocks, pipe.block_size))
        assert sched.cfg.chunk == WIDTH
        engine = Engine(pipe, Limits(4, 4), pipe.context, drafts=drafts, scheduler=sched)
        try:
            got = _at_once(engine, [*prompts, repeat] if drafts is None else [repeat])
        finally:
            engine.shutdown()
        assert got == (stateful if drafts is None else stateful[2:])
        assert sched.pool.held == 0
    with pytest.raises(ShardlineError, match="at least one stage must be paged"):
        ExportConfig(out=Path("x"), stages=2, static=frozenset({0, 1}), paged=True)


def _at_once(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt at once, GREEDY_24 each (stop tokens not honoured): their tokens."""
    got: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(Request(p, GREEDY_24, frozenset()),
                      lambda ev, i=i: got[i].append(ev.token) if ev.token is not None else done[i].set())
    assert all(d.wait(300) for d in done)
    return got


def test_speculation_through_static_stages_gives_the_plain_tokens(static: Callable[[str], Path],
                                                                  shards: Callable[..., Path],
                                                                  prompts: list[list[int]]) -> None:
    """Prompt lookup drafts: verify steps of several tokens run token by token on the decode
    graph, rejected drafts stay masked in the ring, compaction gathers the ring."""
    repeat = [prompts[0] + prompts[0][-12:]]
    plain = _tokens(shards("gguf", stages=2), repeat)
    drafts = Drafts(LookupDrafter, 4, 8, LOOKUP_PRIOR)
    assert _tokens(static("2"), repeat, drafts) == plain


def test_a_draft_model_over_static_stages_gives_the_plain_tokens(static: Callable[[str], Path],
                                                                shards: Callable[..., Path], prompts: list[list[int]],
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """Self-speculation (the first 6 layers as the draft, K = 3): verify steps of 4 tokens, the
    rejected drafts masked in the ring, and compaction of the ring once 8 slots are masked."""
    first6 = export(ExportConfig(out=tmp_path_factory.mktemp("draft") / "first6", stages=1, weights="gguf",
                                 truncate=6, isolate=False, progress=False))
    draft = DraftModel(first6, load_manifest(static("2")))
    plain = _tokens(shards("gguf", stages=2), prompts[:1])[0]
    final: list[Event] = []
    with LocalPipeline(static("2"), EXACT) as pipe:
        engine = Engine(pipe, Limits(1, 1), pipe.context, SchedulerConfig(chunk=WIDTH, groups=0, compact_at=8),
                        Drafts(draft.drafter, 3, 8))
        try:
            got = [ev.token for ev in generate(engine, prompts[0], GREEDY_24, (), on_final=final.append)]
        finally:
            engine.stop()
    assert got == plain
    spec = final[0].spec
    assert spec is not None and spec.drafted - spec.accepted >= 8, spec  # enough rejected to compact the ring


def _loops(tokens: list[int], longest: int = 8) -> bool:
    """Whether `tokens` repeat with a period of at most `longest` from start to end."""
    return any(all(tokens[i] == tokens[i + k] for i in range(len(tokens) - k)) for k in range(1, longest + 1))


def test_past_the_ring_a_stream_goes_on_with_its_sinks_and_no_loop_at_the_seam(
        static: Callable[[str], Path], shards: Callable[..., Path]) -> None:
    """A ring of 64 with 4 sinks, 96 tokens after each of 4 prompts: every stream runs to its
    length; until its cache fills the ring its tokens are the stateful stage's; the 32 after
    the seam do not fall into a loop."""
    tok = ChatTokenizer(static("sinks"))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
    assert all(WIDTH < len(p) < SMALL_RING - 8 for p in prompts)
    cfg = SamplingConfig(max_tokens=96)
    with LocalPipeline(shards("gguf", stages=1), EXACT) as pipe:
        full = [engine_tokens(pipe, p, cfg, chunk=WIDTH, groups=0) for p in prompts]
    with LocalPipeline(static("sinks"), EXACT) as pipe:
        slid = [engine_tokens(pipe, p, cfg, chunk=WIDTH, groups=0) for p in prompts]
    for p, ours, theirs in zip(prompts, slid, full, strict=True):
        seam = SMALL_RING - len(p)  # the first token whose step finds the ring full
        assert len(ours) == 96 and ours[:seam] == theirs[:seam]
        assert not _loops(ours[seam : seam + 32]), ours


def test_speculation_past_the_ring_goes_on_with_its_drafts_masked_in_the_sliding_ring(
        static: Callable[[str], Path], shards: Callable[..., Path]) -> None:
    """Prompt lookup over a ring of 64 with 4 sinks, as `serve` schedules it (a slid cache is never
    compacted: its rejected drafts stay masked and slide out): 96 tokens after each of 2 prompts
    that repeat themselves, every one to its length; the tokens before a step can have filled
    the ring are the stateful stage's, and the 32 after the ring fills do not loop."""
    m = load_manifest(static("sinks"))
    cfg = scheduling(ServeConfig(prefill_chunk=WIDTH), m, remote=False, spec=SpeculationConfig(draft="ngram", k=4))
    assert (cfg.groups, cfg.chunk, cfg.compact_at) == (0, WIDTH, 1 << 30)
    tok = ChatTokenizer(static("sinks"))
    prompts = [tok.encode_chat([{"role": "user", "content": p}])[:24] * 2 for p in CHAT_PROMPTS[:2]]
    drafts, sampling = Drafts(LookupDrafter, 4, 8, LOOKUP_PRIOR), SamplingConfig(max_tokens=96)
    with LocalPipeline(shards("gguf", stages=1), EXACT) as pipe:
        full = [engine_tokens(pipe, p, sampling, chunk=WIDTH, groups=0) for p in prompts]
    final: list[Event] = []
    with LocalPipeline(static("sinks"), EXACT) as pipe:
        engine = Engine(pipe, Limits(1, 1), 8192, cfg, drafts)
        try:
            slid = [[ev.token for ev in generate(engine, p, sampling, (), on_final=final.append)] for p in prompts]
        finally:
            engine.stop()
    for p, ours, theirs, end in zip(prompts, slid, full, final, strict=True):
        sure = (SMALL_RING - len(p)) // 5  # a verify step of 4 drafts takes 5 slots for at least 1 token
        assert len(ours) == 96 and ours[:sure] == theirs[:sure] and sure >= 3
        assert not _loops(ours[-32:]), ours
        assert end.spec is not None and end.spec.accepted > 0 and end.spec.drafted > end.spec.accepted, end.spec


def test_a_request_past_the_ring_is_refused_before_it_runs(static: Callable[[str], Path],
                                                           prompts: list[list[int]]) -> None:
    with LocalPipeline(static("2"), EXACT) as pipe:
        assert pipe.context == RING
        engine = Engine(pipe, Limits(1, 1), pipe.context)
        try:
            with pytest.raises(ShardlineError, match=f"exceeds the context of {RING}"):
                engine.submit(Request(prompts[0], SamplingConfig(max_tokens=RING), frozenset()), lambda ev: None)
        finally:
            engine.stop()


def test_steps_a_static_stage_cannot_run_fail_alone(static: Callable[[str], Path]) -> None:
    with LocalPipeline(static("1"), EXACT) as pipe:
        wide = run(pipe, prefill(1, KVBook(), list(range(5, 6 + WIDTH)), SamplingParams(), first=True, last=True))
        assert wide[0].error == (f"stage 0: a prompt chunk of {WIDTH + 1} tokens is wider than the prefill "
                                 f"graph's {WIDTH}")
        (fine,) = run(pipe, prefill(2, KVBook(), [5, 6], SamplingParams(), first=True, last=True))
        assert not fine.error  # the stage goes on
    stage = pipe.stages[0]
    stage.open(3)  # a cache of RING - 1 slots (masked drafts: slots run ahead of positions)
    stage.set_kv(3, {n: np.zeros((1, kv, RING - 1, d), np.float32) for n, (_, kv, d) in stage.kv_layout().items()})
    two = StepInputs(np.array([[5, 6]]), np.ones((1, RING + 1), np.int64), np.array([[40, 41]]))
    with pytest.raises(StepRefused, match=f"{RING - 1} slots plus 2 new tokens are past the ring of {RING}"):
        stage.run(3, two)
    with pytest.raises(StepRefused, match="a static stage holds one row"):
        stage.set_kv(3, {n: np.zeros((2, kv, 4, d), np.float32) for n, (_, kv, d) in stage.kv_layout().items()})
    assert stage.slots(3) == RING - 1  # refused: nothing changed


def test_a_manifest_that_says_static_over_a_dynamic_graph_is_refused(shards: Callable[..., Path],
                                                                     tmp_path: Path) -> None:
    folder = tmp_path / "claims"
    shutil.copytree(shards("gguf", stages=1), folder)
    d = json.loads((folder / MANIFEST).read_text())
    d["stages"][0] |= {"runner": "static", "ring": RING}
    (folder / MANIFEST).write_text(json.dumps(d))
    with pytest.raises(ShardlineError, match=r"the manifest says static, but \d+ shapes are dynamic"):
        LocalPipeline(folder, EXACT)


def test_a_stateful_stage_on_an_npu_names_the_static_export(shards: Callable[..., Path]) -> None:
    with pytest.raises(ShardlineError, match=r"on NPU: .*an NPU runs a static export \(shardline export --static\)"):
        LocalPipeline(shards("gguf", stages=1), RunConfig(device="NPU", precision="exact"))


def test_static_export_flags_are_checked() -> None:
    with pytest.raises(ShardlineError, match="--prefill-chunk sizes a static export's prefill graph: it needs"):
        ExportConfig(out=Path("x"), stages=1, prefill_chunk=8)
    with pytest.raises(ShardlineError, match=r"--prefill-chunk must be in 2-64 \(the ring\) tokens, got 65"):
        ExportConfig(out=Path("x"), stages=1, static=frozenset({0}), context=64, prefill_chunk=65)
    with pytest.raises(ShardlineError, match=r"--static names stages \[2\]; the export has stages 0-1"):
        ExportConfig(out=Path("x"), stages=2, static=frozenset({2}))
    with pytest.raises(ShardlineError, match=r"--sinks needs every stage static \(--static\) and 1 <= sinks < 64"):
        ExportConfig(out=Path("x"), stages=2, static=frozenset({1}), context=64, sinks=4)
    with pytest.raises(ShardlineError, match=r"1 <= sinks < 64 \(the ring\), got 64"):
        ExportConfig(out=Path("x"), stages=1, static=frozenset({0}), context=64, sinks=64)


def test_static_takes_every_stage_or_those_listed() -> None:
    assert static_stages(None, 2, None) == frozenset()
    assert static_stages("all", 3, None) == {0, 1, 2} and static_stages("all", None, "0-9,10-29") == {0, 1}
    assert static_stages("1", 2, None) == {1} and static_stages("0,1", 2, None) == {0, 1}
    with pytest.raises(ShardlineError, match=r"--static takes stage numbers separated by commas \(e.g. 1,2\), got 'x'"):
        static_stages("x", 2, None)


def test_a_disaggregated_prefill_instance_keeps_to_the_static_width(static: Callable[[str], Path],
                                                                      prompts: list[list[int]]) -> None:
    """Static stages served 1:1 disaggregated with --prefill-chunk wider than their prefill graph:
    the prefill instance cuts prompts to the graph's width, as one engine does (it used to take
    --prefill-chunk as given, and every prompt longer than the width failed at the static stage)."""
    from shardline.server import open_disaggregated

    want = _tokens(static("2"), prompts[:1])
    front, _ = open_disaggregated(static("2"), EXACT, ServeConfig(disaggregate=(1, 1), prefill_chunk=256))
    try:
        got = [ev.token for ev in generate(front, prompts[0], GREEDY_24, ())]  # type: ignore[arg-type]
    finally:
        front.shutdown()
    assert got == want[0]
