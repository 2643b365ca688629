"""Stage workers placed as Ray actors on a real multi-node Ray cluster on this machine: the
in-process tokens through 2 and 3 placed workers, the printed plan, a dead worker named by its
node, and nothing left listening once the fleet stops."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import psutil
import pytest
from ray.cluster_utils import Cluster

from shardline.cluster.fleet import Fleet, FleetConfig
from shardline.cluster.keygen import keygen
from shardline.config import RunConfig, SamplingConfig
from shardline.errors import ShardlineError
from shardline.export.defaults import planned_folder
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.remote import RemotePipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig
from shardline.wire.tls import Credentials
from tests.conftest import CHAT_PROMPTS
from tests.helpers import Faulty, engine_tokens
from tests.multiproc.procs import serve

SHARDLINE = str(Path(sys.executable).parent / "shardline")
GIB = 1 << 30
N_NEW = 16
RUN = RunConfig(threads=1)  # one core per node, as each node offers Ray
NODE = r"node {} \([0-9a-f]{{8}}\)"


def _node(name: str, memory_gib: int) -> dict[str, object]:
    return {"num_cpus": 1, "memory": memory_gib * GIB, "node_name": name, "resources": {f"node_{name}": 1},
            "include_dashboard": False}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Nodes a (1 GiB) and b (2 GiB): each its own raylet and object store, one CPU each."""
    c = Cluster(initialize_head=True, head_node_args=_node("a", 1))
    try:
        c.add_node(**_node("b", 2))
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def third_node(cluster: Cluster) -> Iterator[None]:
    """Node c (2 GiB) joins for the tests after this point, and leaves after the last."""
    node = cluster.add_node(**_node("c", 2))
    cluster.wait_for_nodes()
    yield
    cluster.remove_node(node)


@pytest.fixture(scope="module")
def four(shards: Callable[..., Path]) -> Path:
    """Stage boundaries the memory split of 30 layers over 1:1:2 GiB gives (0-7, 8-14, 15-29),
    with the last range cut once more so that three nodes can take one stage each."""
    return shards("gguf", layers="0-7,8-14,15-22,23-29")


@pytest.fixture(scope="module")
def in_process(four: Path) -> list[list[int]]:
    """The reference: each prompt's greedy tokens with every stage in this process."""
    local = LocalPipeline(four, RUN)
    return [_tokens(local, prompt) for prompt in _prompts(four)]


def _prompts(folder: Path) -> list[list[int]]:
    tok = ChatTokenizer(folder)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT_PROMPTS[:3]]


def _tokens(pipe: LocalPipeline | RemotePipeline, prompt: list[int]) -> list[int]:
    return engine_tokens(pipe, prompt, SamplingConfig(max_tokens=N_NEW))


def _assert_gone(addresses: list[str], pids: list[int]) -> None:
    for addr in addresses:
        host, _, port = addr.rpartition(":")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # the raylet reaps a killed worker a moment after its port closes
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_printed_plan_follows_memory(cluster: Cluster) -> None:
    out = io.StringIO()
    fleet = Fleet(FleetConfig(cluster.address, coordinator_memory=GIB), RUN, out)
    try:
        fleet.connect()
        plan = fleet.make_plan()
    finally:
        fleet.stop()
    assert plan.spec == "0-7,8-14,15-29"
    lines = plan.describe().splitlines()
    assert lines[0] == ("plan: 30 layers on the coordinator and 2 Ray nodes, by available memory "
                        "(override with --plan 0-7,8-14,15-29)")
    assert lines[1] == "  coordinator        layers 0-7     ( 8)  stage 0       1.0 GiB available  on CPU"
    assert re.fullmatch(NODE.format("a") + r"  layers 8-14    \( 7\)  stage 1       1\.0 GiB available  on CPU",
                        lines[2][2:])
    assert re.fullmatch(NODE.format("b") + r"  layers 15-29   \(15\)  stage 2       2\.0 GiB available  on CPU",
                        lines[3][2:])


def test_two_placed_workers_give_the_in_process_tokens_and_stop_cleanly(cluster: Cluster, four: Path,
                                                                       in_process: list[list[int]],
                                                                       tmp_path: Path) -> None:
    """Under mutual TLS: each actor gets its node folder from keygen's through Ray."""
    out = io.StringIO()
    keygen(tmp_path / "creds", 3)
    cfg = FleetConfig(cluster.address, shards=four, coordinator_memory=GIB, credentials=tmp_path / "creds")
    with Fleet(cfg, RUN, out) as fleet:
        assert fleet.plan is not None
        assert [(a.participant.name, a.layers, a.stages) for a in fleet.plan.workers] == [
            ("a", (8, 14), (1, 1)), ("b", (15, 29), (2, 3))]
        assert "node b (" in out.getvalue() and "stages 2-3" in out.getvalue()
        with pytest.raises(ShardlineError, match="closed the connection"):  # a coordinator in clear
            RemotePipeline(fleet.folder, fleet.addresses, RUN, activations="f32")
        remote = RemotePipeline(fleet.folder, fleet.addresses, RUN, activations="f32",
                                credentials=Credentials.load(tmp_path / "creds" / "node-0"))
        assert [_tokens(remote, prompt) for prompt in _prompts(four)] == in_process
        remote.shutdown()
        addresses, pids = list(fleet.addresses), fleet.watch()
    _assert_gone(addresses, pids)


def test_each_worker_gets_its_stages_devices_and_the_plan_shows_them(cluster: Cluster, four: Path) -> None:
    """`--device CPU,CPU,CPU,NPU` over an export of 4 stateful stages: node b's worker (stages 2-3)
    runs stage 3 on the NPU, which this machine lacks and which would need a static export: it
    fails to start saying so, and the printed plan showed each node's devices."""
    out = io.StringIO()
    fleet = Fleet(FleetConfig(cluster.address, shards=four, coordinator_memory=GIB, restarts=0),
                  RunConfig(device="CPU,CPU,CPU,NPU", threads=1), out)
    with pytest.raises(ShardlineError, match=f"^the stage worker on {NODE.format('b')} \\(layers 15-29\\) failed "
                                             f"to start: .*on NPU: .*shardline export --static"):
        fleet.start()
    fleet.stop()
    rows = out.getvalue().splitlines()[1:]
    assert [row.rsplit("  on ", 1)[1] for row in rows] == ["CPU", "CPU", "CPU,NPU"]
    assert fleet.plan is not None and fleet.coordinator_device == "CPU"


def test_a_dead_worker_is_named_by_its_node(cluster: Cluster, four: Path) -> None:
    """Once Ray may restart it no more (here: never)."""
    died = f"^the stage worker on {NODE.format('b')} \\(layers 15-29\\) died$"
    fleet = Fleet(FleetConfig(cluster.address, shards=four, coordinator_memory=GIB, restarts=0), RUN, io.StringIO())
    with pytest.raises(ShardlineError, match=died), fleet:
        pid = fleet.watch()[1]
        host, _, port = fleet.addresses[1].rpartition(":")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShardlineError, match=died):
            fleet.watch()
        # What the coordinator then meets is a refused connection; leaving the fleet names the node.
        socket.create_connection((host, int(port)), timeout=2)


def test_a_killed_worker_is_restarted_by_ray_on_its_address_and_the_answer_goes_on(
        cluster: Cluster, four: Path, in_process: list[list[int]]) -> None:
    """SIGKILL the last worker's process mid-answer: Ray restarts the actor on its node, where it
    listens on the port it had; the coordinator reconnects and replays the stream, and the
    answer is the in-process one, token for token."""
    with Fleet(FleetConfig(cluster.address, shards=four, coordinator_memory=GIB), RUN, io.StringIO()) as fleet:
        addresses, pids = list(fleet.addresses), fleet.watch()
        remote = RemotePipeline(fleet.folder, fleet.addresses, RUN, activations="f32", reconnect_s=60)
        engine = Engine(remote, Limits(2, 2), 8192, SchedulerConfig(groups=1), replays=Replays(within_s=90))
        try:
            faulty = Faulty(engine, _prompts(four)[:1], 4, lambda: os.kill(pids[1], signal.SIGKILL), N_NEW)
            (final,) = faulty.finals(180)
        finally:
            engine.stop()
            remote.shutdown()
        assert (final.finish, final.error) == ("length", "")
        assert faulty.tokens() == in_process[:1]
        assert faulty.tickets[0].stream is not None and faulty.tickets[0].stream.replays == 1
        now = fleet.watch()
        assert now[0] == pids[0] and now[1] != pids[1]  # the killed one is a new process ...
        listening = {f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(now[1]).net_connections()
                     if c.status == psutil.CONN_LISTEN}
        assert addresses[1] in listening  # ... on the address it had


def test_disaggregated_serving_gets_a_chain_of_workers_per_instance(cluster: Cluster, four: Path,
                                                                    in_process: list[list[int]]) -> None:
    """`serve --disaggregate 1:1 --ray-address`: the plan's chain (a: stage 1, b: stages 2-3)
    placed twice, once per instance, each node's copies planned on half its memory; the answer
    (prefilled on one chain, its KV moved over the links, decoded on the other) is the
    in-process one. SIGTERM stops the server cleanly (143, not Ray's own exit 15), its fleet too."""
    proc = serve(["--ray-address", cluster.address, "--shards", str(four), "--plan", "0-7,8-14,15-29", "--insecure",
                  "--model-id", "m",
                  "--port", "0", "--disaggregate", "1:1", "--max-streams", "2", "--threads", "1"])
    try:
        said = proc.stderr()
        assert "x 2 chains of workers (one per instance)" in said and "as given by --plan" in said, said
        client = openai.OpenAI(base_url=proc.addr, api_key="unused", max_retries=0, timeout=180)
        prompt = CHAT_PROMPTS[0]
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=N_NEW, temperature=0)
        tok = ChatTokenizer(four)
        expected = in_process[0]
        stop = next((i for i, t in enumerate(expected) if t in tok.stop_ids), len(expected))
        assert answer.choices[0].message.content == tok.decode(expected[:stop])
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=60) == 128 + signal.SIGTERM  # Ray's own handler would exit 15
    finally:
        proc.stop()


def test_three_placed_workers_give_the_in_process_tokens(cluster: Cluster, third_node: None, four: Path,
                                                         in_process: list[list[int]]) -> None:
    with Fleet(FleetConfig(cluster.address, shards=four, coordinator_memory=GIB), RUN, io.StringIO()) as fleet:
        assert fleet.plan is not None
        assert [(a.participant.name, a.stages) for a in fleet.plan.workers] == [("a", (1, 1)), ("b", (2, 2)),
                                                                                ("c", (3, 3))]
        remote = RemotePipeline(fleet.folder, fleet.addresses, RUN, activations="f32")
        assert [_tokens(remote, prompt) for prompt in _prompts(four)] == in_process
        remote.shutdown()


def test_generate_on_ray_from_the_command_line(cluster: Cluster, third_node: None, four: Path,
                                               in_process: list[list[int]], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No --shards: the default model exported to this plan comes from the cache (here: the
    export above, so that the test exports nothing more)."""
    spec = "0-7,8-14,15-22,23-29"
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path))
    planned_folder(spec).symlink_to(four)
    run = subprocess.run([SHARDLINE, "generate", "--ray-address", cluster.address, "--plan", spec, "--insecure",
                          "--activations", "f32", "--max-tokens", str(N_NEW), CHAT_PROMPTS[0]],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "as given by --plan" in run.stderr and "preparing" not in run.stderr
    for name in "abc":
        assert f"node {name} (" in run.stderr
    tok = ChatTokenizer(four)
    expected = in_process[0]
    stop = next((i for i, t in enumerate(expected) if t in tok.stop_ids), len(expected))
    assert run.stdout.strip() == tok.decode(expected[:stop]).strip()
