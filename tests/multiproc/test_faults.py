"""No request lost when a worker dies or hangs: real worker processes on loopback, faults injected
mid-generation through the engine. A worker killed (SIGKILL) and restarted on its port: the
streams are replayed on the repaired chain and every answer equals the run without faults, token
for token (exact precision), alone and in a decode group with speculation. A worker stopped
(SIGSTOP) and never continued: the request ends with a clear error within the deadline."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.config import RunConfig, SamplingConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.node.worker import StageWorker
from shardline.pipeline.deadline import Deadlines
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.drafters import LookupDrafter
from shardline.serving.engine import Engine
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from tests.helpers import Faulty, engine_tokens
from tests.multiproc.procs import SHARDLINE, Proc, with_dispositions, worker

N_NEW = 40
TEXTS = ["List five animals that live in the sea, one per line, each with one fact.",
         "Explain in two sentences why the sky is blue."]


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def prompts(three: Path) -> list[list[int]]:
    tok = ChatTokenizer(three)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def clean(three: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The answers without faults (every stage in this process)."""
    with LocalPipeline(three) as local:
        return [engine_tokens(local, p, SamplingConfig(max_tokens=N_NEW), groups=0) for p in prompts]


@pytest.fixture
def inproc_first(three: Path) -> Iterator[StageWorker]:
    """Stage 1 on a worker in this process, to look at what it holds."""
    w = StageWorker(three, 1, 1)
    w.listen("127.0.0.1", 0)
    threading.Thread(target=w.serve_forever, daemon=True).start()
    yield w
    w.stop()


def _restart_after_kill(old: Proc, faulty: Faulty, folder: Path, stage: str) -> Proc:
    """Wait for the kill, then start the worker again on its port (the chain reconnects to it)."""
    assert faulty.faulted.wait(120)
    old.stop()  # reaped
    return worker(folder, stage, port=old.port)


def test_a_worker_killed_mid_answer_is_replaced_and_the_answer_goes_on(
        three: Path, prompts: list[list[int]], clean: list[list[int]], inproc_first: StageWorker) -> None:
    last = worker(three, "2")
    remote = RemotePipeline(three, [f"127.0.0.1:{inproc_first.port}", last.addr], RunConfig(), "f32")
    engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1))
    try:
        faulty = Faulty(engine, prompts[:1], 6, lambda: last.proc.send_signal(signal.SIGKILL), N_NEW)
        last = _restart_after_kill(last, faulty, three, "2")
        (final,) = faulty.finals(120)
        assert (final.finish, final.error) == ("length", "")
        assert faulty.tokens() == clean[:1]  # each token once, none missing, none different
        assert faulty.tickets[0].stream is not None and faulty.tickets[0].stream.replays == 1
    finally:
        engine.stop()
        remote.shutdown()
        last.stop()
    assert remote.stage0.keys() == []  # the stream's old key and its new one, freed here
    deadline = time.monotonic() + 10  # ... and on the worker that lived: the broken session's too
    while (inproc_first.stages[0].keys() or inproc_first.sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert inproc_first.stages[0].keys() == [] and not inproc_first.sessions


def test_a_decode_group_survives_its_middle_worker_killed(three: Path, prompts: list[list[int]],
                                                          clean: list[list[int]]) -> None:
    first, last = worker(three, "1"), worker(three, "2")
    try:
        remote = RemotePipeline(three, [first.addr, last.addr], RunConfig(), "f32")
        engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1), Drafts(LookupDrafter, 3, 8))
        try:
            faulty = Faulty(engine, prompts, 8, lambda: first.proc.send_signal(signal.SIGKILL), N_NEW)
            first = _restart_after_kill(first, faulty, three, "1")
            assert [(f.finish, f.error) for f in faulty.finals(120)] == [("length", "")] * 2
            assert faulty.tokens() == clean
            assert [t.stream.replays for t in faulty.tickets if t.stream] == [1, 1]
        finally:
            engine.stop()
            remote.shutdown()
        assert remote.stage0.keys() == []
    finally:
        first.stop()
        last.stop()


def test_a_hung_worker_ends_the_request_with_why_within_the_deadline(three: Path,
                                                                    prompts: list[list[int]]) -> None:
    first, last = worker(three, "1"), worker(three, "2")
    stopped_at: list[float] = []

    def hang() -> None:
        os.kill(last.proc.pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:
        remote = RemotePipeline(three, [first.addr, last.addr], RunConfig(), "f32",
                                deadlines=Deadlines(floor_s=1.0, multiple=5.0), reconnect_s=2.0)
        engine = Engine(remote, Limits(4, 4), 8192, SchedulerConfig(groups=1), replays=Replays(within_s=2.0))
        try:
            faulty = Faulty(engine, prompts[:1], 4, hang, N_NEW)
            (final,) = faulty.finals(60)
            took = time.monotonic() - stopped_at[0]
        finally:
            engine.stop()
            remote.shutdown()
        stopped_one = re.escape(last.addr)  # not the first worker: it answered its pings meanwhile
        assert final.finish == "error"
        assert re.fullmatch(rf"the pipeline broke and could not be repaired within 2 s: worker {stopped_one} "
                            r"did not answer a decode step within 1\.0 s; reconnecting for "
                            r"2 s failed: no answer within [12]\.\d s", final.error), final.error
        # the deadline (1 s, but judged only once every quiet link has had a ping to answer:
        # 2.5 s at the default heartbeat; checked every 0.25 s), then one reconnect window (2 s);
        # a second window at most, if the first ended a hair before the repair's 2 s had passed
        assert 4.5 <= took < 8.0, took
        assert len(faulty.tokens()[0]) >= 4  # what came before the hang was delivered
    finally:
        os.kill(last.proc.pid, signal.SIGCONT)
        first.stop()
        last.stop()


def test_generate_takes_its_recovery_settings_from_the_command_line(three: Path) -> None:
    """`shardline generate --step-deadline 1 --reconnect-window 2 --replay-within 2` on workers
    (and `--step-deadline-multiple 1`: under load, 20 x a 55 ms step outgrew the 1 s floor), its
    last worker stopped once the answer has begun: the command ends within seconds with the
    pipeline's reason, naming the deadline and the window it was given (not the defaults: 10 s
    each, which would take 20 s and more)."""
    first, last = worker(three, "1"), worker(three, "2")
    cmd = with_dispositions([SHARDLINE, "generate", TEXTS[0], "--shards", str(three), "--workers",
                             f"{first.addr},{last.addr}", "--insecure", "--activations", "f32",
                             "--max-tokens", "400", "--step-deadline", "1", "--reconnect-window", "2",
                             "--replay-within", "2", "--step-deadline-multiple", "1"])
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert gen.stdout is not None and select.select([gen.stdout], [], [], 60)[0], "no answer began"
        os.kill(last.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = gen.communicate(timeout=30)
        took = time.monotonic() - stopped
        assert gen.returncode == 1
        line = err.decode().strip().splitlines()[-1]
        assert line.startswith("shardline: error: the pipeline broke and could not be repaired within 2 s: ")
        assert f"worker {last.addr} did not answer a decode step within 1.0 s; reconnecting for 2 s failed" in line
        assert took < 10.0, took
    finally:
        gen.kill()
        gen.wait(timeout=30)
        os.kill(last.proc.pid, signal.SIGCONT)
        first.stop()
        last.stop()
