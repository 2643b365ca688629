"""A paged export served (issue 41): `export --paged`, PagedPipeline and the paged scheduler give
exactly the stateful export's greedy tokens, with streams joining and leaving, prompts fused
beside decode tokens or not (a small budget against a large one), prompts sharing a kept
prefix by block, and a pool so small that streams are preempted and prefilled again."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from shardline.config import ExportConfig, RunConfig, SamplingConfig, ServeConfig, SpeculationConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.paged_local import PagedPipeline
from shardline.server import open_disaggregated, open_engine
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts, SpecStats
from shardline.stage.paged_runner import PagedRunner
from tests.conftest import CHAT_PROMPTS, DEFAULT_SPLIT
from tests.helpers import greedy_ours, staggered

LENGTHS = [20, 24, 6, 16, 9]
MiB = 2**20


@pytest.fixture(scope="module")
def paged(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers=DEFAULT_SPLIT, paged=True)


@pytest.fixture(scope="module")
def prompts(paged: Path) -> list[list[int]]:
    tok = ChatTokenizer(paged)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]


@pytest.fixture(scope="module")
def alone(shards: Callable[..., Path], prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone through the stateful export of the same split: the reference."""
    with LocalPipeline(shards("gguf", layers=DEFAULT_SPLIT), RunConfig()) as pipe:
        return [greedy_ours(pipe, p, n)[0] for p, n in zip(prompts, LENGTHS, strict=True)]


@contextmanager
def _engine(folder: Path, chunk: int, kv_mib: int = 512, prefix: bool = False,
            pacing: bool = False, context: int | None = None) -> Iterator[Engine]:
    pipe = PagedPipeline(folder, RunConfig(context=context), kv_mib * MiB)
    cfg = SchedulerConfig(chunk=chunk, pacing=ServeConfig().pacing if pacing else None)
    scheduler = PagedScheduler(cfg, BlockPool(pipe.blocks, pipe.block_size), prefix=prefix,
                               block_bytes=pipe.pool_bytes // pipe.blocks)
    engine = Engine(pipe, Limits(8, 8), pipe.context, scheduler=scheduler)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_the_export_is_paged(paged: Path) -> None:
    m = load_manifest(paged)
    assert [e.runner for e in m.stages] == ["paged", "paged"]
    assert m.stages[0].state == sorted(f"{k}_cache.{i}" for k in ("key", "value") for i in range(19))


@pytest.mark.parametrize("chunk", [512, 7], ids=["fused-whole", "small-chunks"])
def test_streams_equal_the_stateful_tokens(paged: Path, prompts: list[list[int]], alone: list[list[int]],
                                           chunk: int) -> None:
    """Streams join while others decode (their prompts ride in the same calls as the decode
    tokens) and leave at different steps: each gets its tokens alone on the stateful stages."""
    with _engine(paged, chunk) as engine:
        assert staggered(engine, prompts, LENGTHS) == alone
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.pool.held == 0  # every block back


def test_paced_prompts_equal_too(paged: Path, prompts: list[list[int]], alone: list[list[int]]) -> None:
    with _engine(paged, 128, pacing=True) as engine:
        assert staggered(engine, prompts, LENGTHS) == alone


def test_a_small_pool_preempts_and_stays_exact(paged: Path, prompts: list[list[int]],
                                                alone: list[list[int]]) -> None:
    """A pool that holds little more than one stream at the full context: decode tokens that
    find it empty preempt the youngest idle stream, which prefills again; tokens are unchanged."""
    m = load_manifest(paged)
    per_block = 2 * m.arch.n_layers * m.arch.n_kv_heads * m.arch.head_dim * 4 * 32  # f32 keys and values
    pipe_blocks = -(-2048 // 32) + 3  # a stream at a context of 2,048, and 3 blocks
    with _engine(paged, 64, kv_mib=-(-pipe_blocks * per_block // MiB), context=2048) as engine:
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.pool.size == pipe_blocks
        prompt = list(range(1, 2000))  # nearly the whole pool, beside the chat streams
        done = threading.Event()
        engine.submit(Request(prompt, SamplingConfig(max_tokens=30), frozenset()),
                      lambda ev: done.set() if ev.finish else None)
        assert staggered(engine, prompts, LENGTHS) == alone
        assert done.wait(300)
        assert sched.preempted > 0 and sched.pool.held == 0


def test_a_kept_prefix_is_shared_by_block(paged: Path, prompts: list[list[int]]) -> None:
    """A prompt that starts with an ended stream's prompt takes its full blocks without a copy
    (no prompt token of theirs runs again) and gets the tokens it gets cold."""
    system = list(range(100, 300))  # 200 tokens, then the chat template's own start
    first, second = system + prompts[0], system + prompts[1]
    with _engine(paged, 512) as engine:
        cold = _tokens(engine, second, 12)[0]
    with _engine(paged, 512, prefix=True) as engine:
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler)
        _tokens(engine, first, 4)
        assert sched.stats.tokens_saved == 0
        assert _tokens(engine, second, 12)[0] == cold
        common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        assert common > 200 and sched.stats.tokens_saved == common // 32 * 32  # every full block shared, no more
        stats, held = engine.prefix_stats()  # what /metrics reports
        assert (stats.hits, stats.misses) == (1, 1) and held == sched.pool.cached * sched.block_bytes > 0


def test_speculation_on_paged_gives_the_plain_tokens(paged: Path, shards: Callable[..., Path]) -> None:
    """Prompt-lookup drafts ride after each stream's token in the fused step and are verified
    there; the rejected ones go by a shorter past (their blocks freed). Greedy and seeded
    sampling both give what the stateful export gives without speculation."""
    tok = ChatTokenizer(paged)
    text = "The cat sat on the mat. The dog sat on the log. " * 6
    prompts = [tok.encode_chat([{"role": "user", "content": f"Repeat this text exactly: {text}"}]),
               tok.encode_chat([{"role": "user", "content": f"Copy: {text} {text}"}])]
    samplings = [SamplingConfig(max_tokens=40), SamplingConfig(max_tokens=40, temperature=0.8, seed=5)]
    plain = {}
    engine, _ = open_engine(shards("gguf", layers=DEFAULT_SPLIT), RunConfig(), ServeConfig(max_streams=4))
    try:
        for i, (p, sc) in enumerate(zip(prompts, samplings, strict=True)):
            plain[i] = _tokens(engine, p, 40, sc)[0]
    finally:
        engine.shutdown()
    cfg = ServeConfig(max_streams=4, kv_cache_mb=512)
    engine, _ = open_engine(paged, RunConfig(), cfg, spec=SpeculationConfig(draft="ngram", k=4))
    try:
        got = {i: _tokens(engine, p, 40, sc) for i, (p, sc) in enumerate(zip(prompts, samplings, strict=True))}
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.pool.held == 0
    finally:
        engine.shutdown()
    assert {i: t for i, (t, _) in got.items()} == plain
    assert all(stats is not None and stats.accepted > 5 for _, stats in got.values())  # drafts did stand


@pytest.fixture(scope="module")
def first6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Self-speculation's draft on blocks: the default model's first 6 layers, one paged stage."""
    return export(ExportConfig(out=tmp_path_factory.mktemp("draft") / "first6", stages=1, weights="gguf", truncate=6,
                               paged=True, isolate=False, progress=False))


def test_a_paged_draft_model_beside_a_paged_target_gives_the_plain_tokens(
        paged: Path, prompts: list[list[int]], first6: Path) -> None:
    """Issue 56: self-speculation on blocks. The draft (the model's first 6 layers, exported
    paged) holds each drafter's KV as a block table over its one pool; a rejected draft is
    dropped by a shorter past, its blocks back. Two greedy streams at once give what the paged
    target gives without drafts, and every draft block is back once they end. (Sampled drafts
    keep the target's distribution, not its draws: tests/serving/test_speculative_drafts.py.)"""
    sampling = SamplingConfig(max_tokens=40)
    from shardline.stage.draft_model import DraftModel

    with _engine(paged, 512) as engine:
        plain = [_tokens(engine, p, 40, sampling)[0] for p in prompts[:2]]
    draft = DraftModel(first6, load_manifest(paged))
    assert draft.paged is not None and draft.runner is None
    pipe = PagedPipeline(paged, RunConfig(), 512 * MiB)
    scheduler = PagedScheduler(SchedulerConfig(chunk=512), BlockPool(pipe.blocks, pipe.block_size))
    engine = Engine(pipe, Limits(8, 8), pipe.context, drafts=Drafts(draft.drafter, 3, 8), scheduler=scheduler)
    try:
        got = _burst(engine, prompts[:2], 40, sampling)
        stats = engine.spec.ended
    finally:
        engine.shutdown()
    assert got == plain
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted  # some stood, some were dropped
    assert len(draft.free) == draft.paged.blocks and scheduler.pool.held == 0


def test_a_paged_drafts_blocks_run_out_with_a_clear_error_and_come_back(paged: Path, first6: Path) -> None:
    """A paged draft's pool (here one stream at a context of 64: 2 blocks of 32) is shared by
    every drafter: one that finds too few free blocks fails with nothing changed (its stream
    loses its drafts only), and blocks given back by a shorter past serve it."""
    from shardline.stage.draft_model import DraftModel

    draft = DraftModel(first6, load_manifest(paged), RunConfig(context=64), streams=1)
    assert draft.paged is not None and draft.paged.blocks == 2
    a, b = draft.kv(1), draft.kv(2)
    a.feed(list(range(10, 50)))
    with pytest.raises(ShardlineError, match="the draft model's pool has 0 free blocks; 1 more are needed"):
        b.feed([5])
    assert b.position == 0 and a.position == 40
    a.drop(20)  # 20 tokens left: 1 block
    assert b.feed([5]).shape == (load_manifest(paged).arch.vocab,) and draft.free == []
    a.close()
    b.close()
    assert sorted(draft.free) == [0, 1]


def test_a_paged_export_refuses_what_it_does_not_run(paged: Path, shards: Callable[..., Path]) -> None:
    with pytest.raises(ShardlineError, match="--length-predictor: "):  # a model file that is not there
        open_disaggregated(paged, RunConfig(), ServeConfig(disaggregate=(1, 1), length_predictor="model.json"))
    with pytest.raises(ShardlineError, match="blocks of 32 tokens; one stream at the context of 8192 needs 256"):
        PagedPipeline(paged, RunConfig(), 1 * MiB)
    with pytest.raises(ShardlineError, match="is not a paged export"):
        PagedPipeline(shards("gguf", layers=DEFAULT_SPLIT), RunConfig(), 256 * MiB)
    with pytest.raises(ShardlineError, match="--kv-cache-mb 1048576 is more than --memory-fraction"):
        open_engine(paged, RunConfig(), ServeConfig(kv_cache_mb=1 << 20))
    with pytest.raises(ShardlineError, match="--kv-cache-mb must be in 1-"):
        ServeConfig(kv_cache_mb=0)
    stateful = shards("gguf", layers=DEFAULT_SPLIT)
    entry = load_manifest(stateful).stages[0]
    with pytest.raises(ShardlineError, match="is a 'stateful' stage, not a paged one"):
        PagedRunner.load(stateful, entry, RunConfig(), 8)
    with pytest.raises(ShardlineError, match="cannot load stage0 .* not a cut paged graph"):  # a manifest that lies
        PagedRunner.load(stateful, replace(entry, runner="paged"), RunConfig(), 8)
    with pytest.raises(ShardlineError, match="--paged with --static: .* at least one stage must be paged"):
        ExportConfig(out=paged, stages=2, paged=True, static=frozenset({0, 1}))


def _tokens(engine: Engine, prompt: list[int], n: int,
            sampling: SamplingConfig | None = None) -> tuple[list[int], SpecStats | None]:
    """`n` tokens (stop tokens ignored) and the request's speculation figures."""
    got: list[int] = []
    done = threading.Event()
    stats: list[SpecStats | None] = []

    def on(ev: Event) -> None:
        if ev.token is not None:
            got.append(ev.token)
        else:
            assert ev.finish == "length", ev
            stats.append(ev.spec)
            done.set()

    engine.submit(Request(prompt, sampling or SamplingConfig(max_tokens=n), frozenset()), on)
    assert done.wait(300)
    return got, stats[0]


@pytest.mark.parametrize("transfer", ["request", "chunk"])
def test_disaggregated_serving_moves_blocks_and_gives_the_stateful_tokens(
        paged: Path, prompts: list[list[int]], alone: list[list[int]], transfer: str) -> None:
    """1 prefill + 1 decode instance, each a paged pipeline with its own pool: a prefilled
    stream's blocks are read out of the prefill instance's pool and written into blocks the
    decode instance takes (whatever their ids there); every stream gets its tokens alone on the
    stateful stages, and every block goes back on both. `chunk` (issue 56): prompts in chunks
    of 16, each chunk's full blocks read out as it has run, the slices joined on arrival."""
    cfg = ServeConfig(disaggregate=(1, 1), kv_cache_mb=1024, kv_transfer=transfer, prefill_chunk=16)
    front, _ = open_disaggregated(paged, RunConfig(), cfg)
    try:
        assert staggered(front, prompts, LENGTHS) == alone  # type: ignore[arg-type]
        for role in (*front.prefills.values(), *front.decodes.values()):
            sched = role.engine.scheduler
            assert isinstance(sched, PagedScheduler) and sched.pool.held == 0
    finally:
        front.shutdown()


def test_an_idle_decode_instance_flips_to_prefill_and_no_request_is_lost(paged: Path,
                                                                         prompts: list[list[int]]) -> None:
    """Issue 56: `--flip` on a paged export. 1 prefill + 2 decode instances; a burst of long
    prompts queues on the prefill instance while both decode instances idle, so one of them
    takes the prefill role over its own pipeline and pool. Every request gets the tokens of a
    coupled paged engine, and every block goes back on every instance."""
    from shardline.disagg.front import FrontConfig
    from shardline.disagg.instance import FlipConfig
    from shardline.disagg.state import Role

    burst = [prompts[i % 5] * 3 for i in range(8)]
    with _engine(paged, 512) as engine:
        alone = [_tokens(engine, p, 6)[0] for p in burst]
    cfg = ServeConfig(disaggregate=(1, 2), flip=True, kv_cache_mb=1536, prefix_cache_mb=0)
    front_cfg = FrontConfig(heavy_from=64, period_s=0.02, flip=FlipConfig(idle_s=0.05, pressure=1.0))
    front, _ = open_disaggregated(paged, RunConfig(context=2048), cfg, front_cfg=front_cfg)
    try:
        assert _burst(front, burst, 6) == alone  # type: ignore[arg-type]
        assert [(f.old, f.new) for f in front.flips][:1] == [(Role.DECODE, Role.PREFILL)]
        assert len(front.prefills) + len(front.decodes) == 3 and front.decodes and front.failed is None
        for role in (*front.prefills.values(), *front.decodes.values()):
            sched = role.engine.scheduler
            assert isinstance(sched, PagedScheduler) and sched.pool.held == 0
    finally:
        front.shutdown()


def _burst(engine: Engine, prompts: list[list[int]], n: int,
           sampling: SamplingConfig | None = None) -> list[list[int]]:
    """Every prompt at once, `n` tokens each (or as `sampling` says): their tokens."""
    got: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on(i: int) -> Callable[[Event], None]:
        return lambda ev: got[i].append(ev.token) if ev.token is not None else done[i].set()

    for i, p in enumerate(prompts):
        engine.submit(Request(p, sampling or SamplingConfig(max_tokens=n), frozenset()), on(i))
    assert all(d.wait(300) for d in done)
    return got
