"""Stage workers as Ray actors: placed by memory, started, watched and stopped through Ray.

Ray is the control plane only. Each actor hosts a `StageWorker` listening on its node's address,
and the coordinator's `RemotePipeline` connects to those addresses exactly as with `--workers`:
no token ever goes through a Ray call.

A worker whose process dies is restarted by Ray (up to `FleetConfig.restarts` times) on the same
node, where it listens on the port it was given at launch (found free there by a small Ray task
first): its address does not change, so the coordinator's
repair reconnects to it and replays the streams that were in flight (issue 11), as it does for a
static worker restarted on its port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shardline.cluster.keygen import node_folders
from shardline.cluster.placement import Assignment, Participant, Plan, place
from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.export.defaults import default_model_layers, planned_shards
from shardline.host import available_memory, parse_hostport
from shardline.model.manifest import load_manifest
from shardline.node.worker import StageWorker
from shardline.wire.tls import FILES, Credentials

READY_TIMEOUT_S = 600.0  # an actor verifies and compiles its stages before it answers
PING_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class FleetConfig:
    address: str  # the Ray cluster, as `ray.init(address=...)` takes it
    shards: Path | None = None  # an existing export; None: the default model, exported to the plan
    plan: str | None = None  # `--plan`: one layer range per participant, overriding the memory split
    coordinator_memory: int | None = None  # bytes; None: measured on this machine
    # keygen's --out folder: the i-th worker gets node-i's credentials through Ray (actor
    # arguments); None: links in clear (--insecure)
    credentials: Path | None = None
    restarts: int = 3  # times Ray restarts a worker whose process died
    # Copies of the plan's chain of workers (one per instance of disaggregated serving): each
    # node hosts one worker per chain, so each copy is planned on 1/chains of its memory.
    chains: int = 1

    def __post_init__(self) -> None:
        if not self.address:
            raise ShardlineError("--ray-address must name a Ray cluster (HOST:PORT, or auto)")
        if not 0 <= self.restarts <= 100:
            raise ShardlineError(f"worker restarts must be in 0-100, got {self.restarts}")
        if not 1 <= self.chains <= 32:
            raise ShardlineError(f"chains of workers must be 1-32, got {self.chains}")


class StageActor:
    """A stage worker inside a Ray actor process. `folder` is the coordinator's export path, used
    on the actor's node: where it already holds the stages (a shared or one-machine cluster) they
    load now; otherwise the coordinator delivers them into it on connecting, and they stay cached."""

    def __init__(self, folder: str, first: int, last: int, run: RunConfig, pems: dict[str, bytes] | None,
                 port: int) -> None:
        host = ray.util.get_node_ip_address()
        self.worker = StageWorker.empty(Path(folder), first, last, run, _unpack(pems))
        # `port` is fixed for the actor's life: Ray restarts it (same node: hard affinity) with
        # the same arguments, so its address holds.
        self.worker.listen(host, port)
        # Ray calls the actor's methods on its own thread; the chain is served beside them.
        threading.Thread(target=self.worker.serve_forever, daemon=True, name="serve").start()
        self.address = f"{host}:{port}"

    def ready(self) -> str:
        return self.address

    def ping(self) -> int:
        return os.getpid()


def _free_port() -> int:
    """A port free on the node this runs on, for a stage worker to listen on for its life. (Another
    process could take it before the worker binds it; the worker then fails to start, clearly.)"""
    with socket.create_server((ray.util.get_node_ip_address(), 0)) as sock:
        return int(sock.getsockname()[1])


_RemoteStageActor: Any = ray.remote(StageActor)
_remote_free_port: Any = ray.remote(num_cpus=0)(_free_port)


def _pack(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FILES}


def _unpack(pems: dict[str, bytes] | None) -> Credentials | None:
    """An actor's credentials, written to a folder only its user can read, and checked."""
    if pems is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="shardline-credentials-"))
    for name in FILES:
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pems[name])
    return Credentials.load(folder)


class Fleet:
    """Connect, plan, start one actor per worker and wait until each listens; stop on exit.

    After `start()`: `plan`, `folder` (the export every participant loads) and `addresses` (the
    workers' HOST:PORT, in chain order, chain after chain, for `RemotePipeline`s)."""

    def __init__(self, cfg: FleetConfig, run: RunConfig, out: TextIO | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.out = out
        self.plan: Plan | None = None
        self._folder: Path | None = None
        self.addresses: list[str] = []
        self._actors: list[tuple[Assignment, Any]] = []  # every chain's workers, in `addresses` order
        self._connected = False

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if exc is not None and not isinstance(exc, KeyboardInterrupt):
                # A lost worker shows up as a broken link or an unreachable address: name its node.
                # If Ray itself is gone, the original error says more than Ray's would.
                with contextlib.suppress(RayError):
                    self.watch()
        finally:
            self.stop()

    @property
    def coordinator_device(self) -> str:
        """`--device` for the stages the coordinator runs itself."""
        if self.plan is None:
            raise ShardlineError("the fleet has not been started")
        return self.plan.assignments[0].device

    @property
    def folder(self) -> Path:
        if self._folder is None:
            raise ShardlineError("the fleet has not been started")
        return self._folder

    def start(self) -> None:
        self.connect()
        self.plan = self.make_plan().on_devices(self.run.devices)
        copies = f"\n  x {self.cfg.chains} chains of workers (one per instance)" if self.cfg.chains > 1 else ""
        print(self.plan.describe() + copies, file=self.out or sys.stderr, flush=True)
        self._folder = self.cfg.shards.resolve() if self.cfg.shards else planned_shards(self.plan.spec)
        self._launch(self.plan, self._folder)

    def connect(self) -> None:
        _check_reachable(self.cfg.address)
        # ray.init replaces the SIGTERM handler with one that exits 15 on the spot; the command's
        # own (a clean stop, exit 143: signals.py) is put back.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            # Actor output must not reach the driver: stdout carries the generated text.
            ray.init(address=self.cfg.address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ShardlineError(f"cannot connect to the Ray cluster at {self.cfg.address}: {e}") from None
        finally:
            if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
                signal.signal(signal.SIGTERM, on_sigterm)
        self._connected = True

    def make_plan(self) -> Plan:
        me = Participant("coordinator", self.cfg.coordinator_memory or available_memory())
        participants = [replace(p, memory=p.memory // self.cfg.chains) for p in (me, *cluster_nodes())]
        if self.cfg.shards is None:
            return place(participants, default_model_layers(), None, self.cfg.plan)
        manifest = load_manifest(self.cfg.shards)
        stages = [(e.first_layer, e.last_layer) for e in manifest.stages]
        return place(participants, manifest.arch.n_layers, stages, self.cfg.plan)

    def _launch(self, plan: Plan, folder: Path) -> None:
        chains = [list(plan.workers) for _ in range(self.cfg.chains)]
        placed = [a for chain in chains for a in chain]
        creds = node_folders(self.cfg.credentials) if self.cfg.credentials else None
        if creds is not None and len(creds) < 1 + len(placed):
            raise ShardlineError(f"{self.cfg.credentials} has {len(creds)} node folders; this plan needs "
                                 f"{1 + len(placed)} (the coordinator's and one per worker)")
        for i, a in enumerate(placed, start=1):
            pems = _pack(creds[i]) if creds else None
            # Hard affinity: the plan chose this node. One core in Ray's books per node, shared
            # by its chains' workers.
            on_node = NodeAffinitySchedulingStrategy(a.participant.node_id, soft=False)
            port = ray.get(_remote_free_port.options(scheduling_strategy=on_node).remote(), timeout=READY_TIMEOUT_S)
            options = {"num_cpus": 1 / self.cfg.chains, "max_restarts": self.cfg.restarts,
                       "scheduling_strategy": on_node}
            run = replace(self.run, device=a.device)
            actor = _RemoteStageActor.options(**options).remote(str(folder), *a.stages, run, pems, port)
            self._actors.append((a, actor))
        readies = [actor.ready.remote() for _, actor in self._actors]
        for (a, _), ref in zip(self._actors, readies, strict=True):
            try:
                self.addresses.append(ray.get(ref, timeout=READY_TIMEOUT_S))
            except RayActorError as e:
                raise ShardlineError(f"the stage worker on {_where(a)} failed to start: {_reason(e)}") from None
            except GetTimeoutError:
                raise ShardlineError(f"the stage worker on {_where(a)} did not start within "
                                     f"{READY_TIMEOUT_S:.0f} s (is the node's CPU taken?)") from None

    def watch(self) -> list[int]:
        """Health check: every worker's process id, or a ShardlineError naming the first node
        whose worker is gone or does not answer."""
        pings = [actor.ping.remote() for _, actor in self._actors]
        pids = []
        for (a, _), ref in zip(self._actors, pings, strict=True):
            try:
                pids.append(ray.get(ref, timeout=PING_TIMEOUT_S))
            except RayActorError:
                raise ShardlineError(f"the stage worker on {_where(a)} died") from None
            except GetTimeoutError:
                raise ShardlineError(f"the stage worker on {_where(a)} does not answer "
                                     f"within {PING_TIMEOUT_S:.0f} s") from None
        return pids

    def stop(self) -> None:
        """Kill exactly this fleet's actors, wait until their ports close, and disconnect."""
        for _, actor in self._actors:
            with contextlib.suppress(RayError):  # already dead, or its node gone with it
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for addr in self.addresses:
            _wait_closed(addr, deadline)  # ray.kill only asks; the process exits a moment later
        self._actors, self.addresses = [], []
        if self._connected:
            ray.shutdown()
            self._connected = False


def cluster_nodes() -> list[Participant]:
    """Alive nodes that offer Ray a CPU, with their "memory" resource, by name then id (the same
    order on every call, whatever order the nodes joined in)."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
    found = [Participant(n["NodeName"], int(n["Resources"].get("memory", 0)), n["NodeID"]) for n in nodes]
    return sorted(found, key=lambda p: (p.name, p.node_id))


def _where(a: Assignment) -> str:
    return f"{a.participant.label} (layers {a.layers[0]}-{a.layers[1]})"


def _reason(e: RayActorError) -> str:
    """The actor's own exception line out of Ray's report (traceback and colour codes dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", getattr(e, "error_msg", "") or str(e))
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else type(e).__name__
    kind, _, message = last.partition(": ")
    return message if kind.endswith("ShardlineError") else last


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody listens on: ray.init would retry for minutes."""
    if "://" in address or address == "auto":
        return  # left to Ray
    host, port = parse_hostport(address, "--ray-address")
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise ShardlineError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def _wait_closed(addr: str, deadline: float) -> None:
    host, port = parse_hostport(addr, "worker")
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
