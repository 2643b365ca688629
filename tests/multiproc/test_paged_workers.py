"""A paged export over real worker processes on loopback (issue 41): stage 0 here, stages 1 and 2
on workers, each holding a pool of the same blocks for this coordinator's session; ragged steps
cross the wire as `Ragged` frames, one in flight per stage. Streams that join and leave give the
tokens every stage in this process gives, daisy chain and star, greedy and seeded; a worker
killed mid-answer and restarted: the streams are replayed (the blocks went with it) and every
answer is the same, token for token."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest

from shardline.config import RunConfig, SamplingConfig, ServeConfig, SpeculationConfig
from shardline.model.manifest import load_manifest
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.paged_local import PagedPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.server import open_engine
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine, Event, Request
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.scheduler import SchedulerConfig
from tests.conftest import CHAT_PROMPTS
from tests.helpers import Faulty, staggered
from tests.multiproc.procs import Proc, worker, workers_of

LENGTHS = [20, 12, 16, 9]
MiB = 2**20
KV = 400 * MiB  # 284 blocks of 32 tokens: one stream at the full context and a little more


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", layers="0-9,10-19,20-29", paged=True)


@pytest.fixture(scope="module")
def prompts(three: Path) -> list[list[int]]:
    tok = ChatTokenizer(three)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[: len(LENGTHS)]]


@pytest.fixture(scope="module")
def workers(three: Path) -> Iterator[list[Proc]]:
    with workers_of(three, "1", "2") as ws:
        yield ws


@contextmanager
def _engine(pipe: PagedPipeline | RemotePipeline, in_flight: int, chunk: int = 512) -> Iterator[Engine]:
    scheduler = PagedScheduler(SchedulerConfig(chunk=chunk), BlockPool(pipe.blocks, pipe.block_size),
                               in_flight=in_flight)
    engine = Engine(pipe, Limits(8, 8), pipe.context, scheduler=scheduler)
    try:
        yield engine
    finally:
        engine.shutdown()
        pipe.shutdown()


@pytest.fixture(scope="module")
def here(three: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Every stage in this process, one step at a time: the reference."""
    with _engine(PagedPipeline(three, RunConfig(), KV), 1) as engine:
        return staggered(engine, prompts, LENGTHS)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_workers_give_the_in_process_tokens(three: Path, workers: list[Proc], prompts: list[list[int]],
                                            here: list[list[int]], topology: str) -> None:
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", topology, kv_bytes=KV)
    with _engine(remote, 3, chunk=7) as engine:  # prompts in 7-token chunks beside the decode tokens
        assert staggered(engine, prompts, LENGTHS) == here
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.pool.held == 0


def test_seeded_sampling_is_the_same_over_workers(three: Path, workers: list[Proc], prompts: list[list[int]]) -> None:
    sampling = SamplingConfig(max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=11)
    with _engine(PagedPipeline(three, RunConfig(), KV), 1) as engine:
        want = _answers(engine, prompts[:3], sampling)
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", kv_bytes=KV)
    with _engine(remote, 3) as engine:
        assert _answers(engine, prompts[:3], sampling) == want


def _answers(engine: Engine, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
    """Every prompt at once (stop tokens not honoured): their tokens."""
    got: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on(i: int) -> Callable[[Event], None]:
        return lambda ev: got[i].append(ev.token) if ev.token is not None else done[i].set()

    for i, p in enumerate(prompts):
        engine.submit(Request(p, sampling, frozenset()), on(i))
    assert all(d.wait(300) for d in done)
    return got


def test_a_worker_killed_mid_answer_is_replayed_with_the_same_tokens(three: Path, prompts: list[list[int]],
                                                                     here: list[list[int]]) -> None:
    first, last = worker(three, "1"), worker(three, "2")
    remote = RemotePipeline(three, [first.addr, last.addr], RunConfig(), "f32", kv_bytes=KV)
    n = min(LENGTHS[:2])
    try:
        with _engine(remote, 3) as engine:
            faulty = Faulty(engine, prompts[:2], 5, lambda: last.proc.send_signal(signal.SIGKILL), n)
            assert faulty.faulted.wait(120)
            last.stop()
            last = worker(three, "2", port=last.port)
            assert [(f.finish, f.error) for f in faulty.finals(120)] == [("length", "")] * 2
            assert faulty.tokens() == [t[:n] for t in here[:2]]
            assert [t.stream.replays for t in faulty.tickets if t.stream] == [1, 1]
            sched = engine.scheduler
            assert isinstance(sched, PagedScheduler) and sched.pool.held == 0
    finally:
        first.stop()
        last.stop()


def test_serve_opens_a_paged_export_over_workers(three: Path, workers: list[Proc], prompts: list[list[int]],
                                                 here: list[list[int]]) -> None:
    """What `serve --workers` builds for a paged export: stage 0 here with its pool, the workers
    after it, one step in flight per machine (issue 56: these workers share this machine's
    cores, so every stream's tokens ride in one step)."""
    cfg = ServeConfig(kv_cache_mb=KV // MiB, max_streams=4)
    engine, _ = open_engine(three, RunConfig(), cfg, workers=[w.addr for w in workers], activations="f32")
    try:
        sched = engine.scheduler
        assert isinstance(sched, PagedScheduler) and sched.in_flight == 1
        assert [p.where for p in engine.pipe.placement()] == ["this process", *(w.addr for w in workers)]
        assert staggered(engine, prompts, LENGTHS) == here
    finally:
        engine.shutdown()


def test_a_kept_prefix_is_shared_by_block_over_workers(three: Path, workers: list[Proc],
                                                      prompts: list[list[int]]) -> None:
    """A prompt that starts with an ended stream's prompt reads its full blocks on every worker
    (none of those tokens runs again) and gets the tokens it gets cold."""
    system = list(range(100, 300))
    first, second = system + prompts[0], system + prompts[1]
    sampling = SamplingConfig(max_tokens=10)
    with _engine(PagedPipeline(three, RunConfig(), KV), 1) as engine:
        (cold,) = _answers(engine, [second], sampling)
    remote = RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", kv_bytes=KV)
    scheduler = PagedScheduler(SchedulerConfig(chunk=512), BlockPool(remote.blocks, remote.block_size), prefix=True,
                               in_flight=3)
    engine = Engine(remote, Limits(8, 8), remote.context, scheduler=scheduler)
    try:
        _answers(engine, [first], SamplingConfig(max_tokens=2))
        assert _answers(engine, [second], sampling) == [cold]
        assert scheduler.stats.hits == 1 and scheduler.stats.tokens_saved >= 192
    finally:
        engine.shutdown()


def test_hostile_tables_on_the_wire_are_refused_and_change_nothing(three: Path, workers: list[Proc]) -> None:
    """A coordinator's frames to a paged worker process over a real link: a table outside the
    session's pool, one too short for its tokens, a block one sequence writes in another's table
    are each refused (StepFailed, the link open); the step after them gets the token it gets
    without them. A coordinator that is not paged, or whose pool does not fit, is refused."""
    from dataclasses import replace

    from shardline.wire.messages import MAX_BLOCKS, Refuse, Route, Sampled, StepFailed
    from tests.model.test_paged_worker import _step
    from tests.multiproc.test_worker_hostile import Peer, _hello

    m = load_manifest(three)
    last = workers[1].addr
    paged = replace(_hello(m, 2), block_size=32, blocks=300)

    def token(peer: Peer, seqs: list[tuple[int, int, list[int]]], seed: int) -> int:
        peer.send(_step(seqs, seed=seed))
        reply = peer.recv()
        assert isinstance(reply, Sampled), reply
        return int(reply.tokens[-1])

    clean = Peer(last, paged)
    clean.send(Route(""))
    token(clean, [(5, 0, [0])], 0)
    want = token(clean, [(1, 5, [0])], 1)
    peer = Peer(last, replace(paged, session="ab" * 16))
    peer.send(Route(""))
    token(peer, [(5, 0, [0])], 0)
    for seqs, why in [([(5, 0, [0]), (1, 0, [300])], "points outside the pool of 300 blocks"),
                      ([(5, 0, [0]), (40, 0, [1])], "40 tokens need 2 blocks, its table has 1"),
                      ([(5, 0, [0]), (1, 32, [0, 1])], "sequence 1 reads block 0, which sequence 0 writes")]:
        peer.send(_step(seqs, seed=7))
        reply = peer.recv()
        assert isinstance(reply, StepFailed) and why in reply.reason, reply
    assert token(peer, [(1, 5, [0])], 1) == want
    for hello, why in [(_hello(m, 2), "the coordinator's stages are not paged"),
                       (replace(paged, blocks=MAX_BLOCKS, session="cd" * 16), "does not fit this worker's")]:
        refused = Peer(last)
        refused.send(hello)
        reply = refused.recv()
        assert isinstance(reply, Refuse) and why in reply.reason, reply
    assert workers[1].proc.poll() is None


def test_a_worker_before_the_last_refuses_masks_the_last_would(three: Path, workers: list[Proc]) -> None:
    """Token masks are checked by every worker as a step comes (issue 54), not passed on
    unchecked to the last one: the first of two workers refuses masks that do not cover the
    vocabulary or allow no token; the same step without them runs."""
    from dataclasses import replace

    from shardline.decoding.masks import mask_words
    from shardline.wire.messages import Ragged, Route, StepFailed
    from tests.model.test_paged_worker import _step
    from tests.multiproc.test_worker_hostile import Peer, _hello

    m = load_manifest(three)
    peer = Peer(workers[0].addr, replace(_hello(m, 1), block_size=32, blocks=8))
    peer.send(Route(""))  # a star: the first worker answers this coordinator itself
    words = mask_words(m.arch.vocab)
    for bits, why in [(np.full((1, 3), -1, np.int32), f"token masks of 3 words for a vocabulary of {m.arch.vocab}"),
                      (np.zeros((1, words), np.int32), "a token mask that allows no token")]:
        peer.send(replace(_step([(5, 0, [0])]), allow_bits=bits, allow_of=np.array([0], np.int64)))
        reply = peer.recv()
        assert isinstance(reply, StepFailed) and why in reply.reason, reply
    peer.send(_step([(5, 0, [0])]))
    assert isinstance(peer.recv(), Ragged)  # its hidden states, on their way to the last worker


def test_speculation_over_workers_gives_the_plain_tokens(three: Path, workers: list[Proc]) -> None:
    """Prompt-lookup drafts ride after each stream's token in the Ragged frame; the last worker
    verifies every position. Greedy and seeded sampling give the tokens of the same export in
    this process without speculation, and drafts stood."""
    tok = ChatTokenizer(three)
    text = "The cat sat on the mat. The dog sat on the log. " * 4
    prompts = [tok.encode_chat([{"role": "user", "content": f"Repeat this text exactly: {text}"}])] * 2
    samplings = [SamplingConfig(max_tokens=24), SamplingConfig(max_tokens=24, temperature=0.8, seed=5)]
    with _engine(PagedPipeline(three, RunConfig(), KV), 1) as engine:
        plain = [_answers(engine, [p], s)[0] for p, s in zip(prompts, samplings, strict=True)]
    cfg = ServeConfig(kv_cache_mb=KV // MiB, max_streams=4)
    engine, _ = open_engine(three, RunConfig(), cfg, workers=[w.addr for w in workers], activations="f32",
                            spec=SpeculationConfig(draft="ngram", k=4))
    try:
        assert [_answers(engine, [p], s)[0] for p, s in zip(prompts, samplings, strict=True)] == plain
        assert engine.spec.ended.accepted > 5  # drafts did stand
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transfer", ["request", "chunk"])
def test_disaggregated_over_workers_moves_blocks_and_gives_the_in_process_tokens(
        three: Path, workers: list[Proc], prompts: list[list[int]], here: list[list[int]], transfer: str) -> None:
    """`serve --disaggregate 1,1` on a paged export over workers: each instance has stage 0 here
    and a session of its own on the same two worker processes (a pool each); a prefilled
    stream's blocks are pulled out of the prefill instance's pools (stage 0's here, each
    worker's over its link) and pushed into blocks the decode instance's scheduler took. Every
    answer is the in-process one, and every block goes back on both instances. `chunk` (issue
    56): prompts in chunks of 16, each chunk's full blocks pulled as it has run (slices that
    start at a block), joined on arrival."""
    from shardline.server import open_disaggregated

    chain = [w.addr for w in workers]
    cfg = ServeConfig(disaggregate=(1, 1), kv_cache_mb=2 * KV // MiB, kv_transfer=transfer, prefill_chunk=16)
    front, _ = open_disaggregated(three, RunConfig(), cfg, workers=chain * 2, activations="f32")
    try:
        assert staggered(front, prompts, LENGTHS) == here  # type: ignore[arg-type]
        for role in (*front.prefills.values(), *front.decodes.values()):
            sched = role.engine.scheduler
            assert isinstance(role.engine.pipe, RemotePipeline)
            assert isinstance(sched, PagedScheduler) and sched.pool.held == 0
    finally:
        front.shutdown()
    assert all(w.proc.poll() is None for w in workers)


def test_stage_0s_prompt_summaries_come_back_over_workers(three: Path, workers: list[Proc],
                                                          prompts: list[list[int]]) -> None:
    """Issue 56: a summarizing paged pipeline over workers (a prefill instance's, for the length
    predictor) hands each prompt's stage-0 summary to the prediction, as in one process: every
    prompt chunk of the fused steps summarized, by stream."""
    from shardline.disagg.prefill import Moving, prefill_instance
    from shardline.disagg.state import LengthRange, bucket
    from shardline.serving.stream import Stream

    def vectors(pipe: PagedPipeline | RemotePipeline) -> dict[tuple[int, ...], np.ndarray]:
        seen: dict[tuple[int, ...], np.ndarray] = {}

        def predict(s: Stream) -> LengthRange:
            assert s.handover.hidden is not None and s.handover.hidden.positions == len(s.prompt)
            seen[tuple(s.prompt)] = s.handover.hidden.vector()
            return bucket(s.max_tokens, 16, 8)

        moved: list[Moving] = []
        arrived = threading.Semaphore(0)
        scheduler = PagedScheduler(SchedulerConfig(chunk=7, max_prefills=4, pacing=None),
                                   BlockPool(pipe.blocks, pipe.block_size), in_flight=pipe.n_stages)
        engine = prefill_instance(pipe, Limits(4, 8), pipe.context, 7, lambda m: (moved.append(m), arrived.release()),
                                  predict, paged=scheduler).engine
        try:
            for p in prompts:
                engine.submit(Request(p, SamplingConfig(max_tokens=20), frozenset()), lambda ev: None)
            assert all(arrived.acquire(timeout=120) for _ in prompts)
        finally:
            engine.shutdown()
            pipe.shutdown()
        return seen

    here = vectors(PagedPipeline(three, RunConfig(), KV, summarize=True))
    there = vectors(RemotePipeline(three, [w.addr for w in workers], RunConfig(), "f32", kv_bytes=KV, summarize=True))
    assert sorted(here) == sorted(there) == sorted(tuple(p) for p in prompts)
    for p, v in here.items():
        np.testing.assert_allclose(there[p], v, rtol=1e-4, atol=1e-4)


LIMIT_MB = 1024  # the audit's pool (issue 54): 2184 blocks of the last stage's 10 layers


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MiB


def _settled_rss_mib(pid: int, seconds: float = 1.5) -> float:
    """The worker's largest RSS over `seconds` (a pool copied into committed pages took 3 s)."""
    deadline, most = time.monotonic() + seconds, 0.0
    while time.monotonic() < deadline:
        most = max(most, _rss_mib(pid))
        time.sleep(0.1)
    return most


def test_a_pool_costs_nothing_until_written_and_none_gets_past_kv_cache_mb(three: Path) -> None:
    """Issue 54: a real worker started with `--kv-cache-mb 1024` takes a Hello asking for the
    largest pool it gives and its RSS stays within 64 MiB of before (the pool's pages are
    committed only as blocks are written; a copied pool took it from 304 to 1,328 MiB); a Hello
    past the limit, alone or beside the pool held, is refused naming the limit and the flag; the
    held session still gets its tokens, and once it ends the next session is served."""
    from dataclasses import replace

    from shardline.model.context import kv_bytes_per_token
    from shardline.wire.messages import Route, Sampled
    from tests.model.test_paged_worker import _step
    from tests.multiproc.test_worker_hostile import Peer, _hello, _refusal_of

    m = load_manifest(three)
    e = m.stages[2]
    block = 32 * kv_bytes_per_token(e.last_layer - e.first_layer + 1, m.arch.n_kv_heads, m.arch.head_dim)
    most = (LIMIT_MB * MiB) // block
    hello = replace(_hello(m, 2), block_size=32, blocks=most)

    def refused(blocks: int, beside: int) -> str:
        return (f"a KV pool of {blocks} blocks ({blocks * block / MiB:.0f} MiB) does not fit this worker's limit "
                f"of {LIMIT_MB} MiB (--kv-cache-mb) beside {beside * block / MiB:.0f} MiB of other sessions' pools")

    def token(peer: Peer, blocks: int) -> int:
        """The token of a 40-token prompt in the pool's last block and its first."""
        peer.send(Route(""))
        peer.send(_step([(40, 0, [blocks - 1, 0])], seed=3))
        reply = peer.recv()
        assert isinstance(reply, Sampled), reply
        return int(reply.tokens[-1])

    with worker(three, "2", extra=["--kv-cache-mb", str(LIMIT_MB)]) as w:
        pid = w.proc.pid
        assert refused(most + 1, 0) in str(_refusal_of(w.addr, replace(hello, blocks=most + 1)))
        before = _settled_rss_mib(pid)
        with Peer(w.addr, hello) as big:
            after = _settled_rss_mib(pid)
            assert after - before < 64, (before, after)
            assert refused(1, most) in str(_refusal_of(w.addr, replace(hello, blocks=1, session="ab" * 16)))
            want = token(big, most)
        # The worker frees a session once it sees its link close: half the limit fits then (a
        # probe's session, closed again at once), and the other half beside it, freed or not.
        half = replace(hello, blocks=most // 2, session="cd" * 16)
        deadline = time.monotonic() + 10
        while (why := _refusal_of(w.addr, half)) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert why is None, why
        with Peer(w.addr, replace(half, session="ef" * 16)) as again:
            assert token(again, most // 2) == want
        assert w.proc.poll() is None
