"""The simulator's disaggregated serving (TetriInfer): prefill and decode instances, the cluster
monitor, the global scheduler, the dispatcher, KV transfer and role flips, on simulator.py's
event loop and time model, with the pure decisions of policies.py and instance.py.

- Instances are named i000, i001, ...: the first `prefill` start as prefill instances, the rest
  as decode instances (roles may flip; names stay).
- The monitor gathers every instance's load at t = 0 and every `monitor_period_s` into a
  `ClusterState`. The global scheduler (`least_loaded_prefill`) and the dispatcher (`dispatch`,
  power of two with the seeded `random.Random`) decide on that snapshot, not on the live state,
  with what they sent since it was gathered added (state.py `sent_prefill` / `sent_decode`), as
  the real front does (front.py): a burst inside one period is spread, not sent to one instance.
- A prefill instance takes the next batch (`next_batch`: policy, PrefillSchedBatch window) and
  prefills it request by request to its end (non-preemptive), one chunk per step (`chunks`);
  with `pad_chunks` every step is `chunk` positions wide and costs so (policies.chunks).
- The length predictor (`predict`, any callable: an oracle, a noisy one, a trained model) runs
  when a request's prefill starts; its time is not charged (it runs beside stage 0).
- The first token is sampled by the last prefill chunk and reaches the client at that chunk's
  end, before any KV moves: TTFT excludes the transfer; JCT and TPOT include it.
- KV moves over the prefill instance's one link, first come first served, each transfer costing
  `Costs.transfer_s` of the KV of the tokens it carries. Request-level: the whole prompt's KV
  once the last chunk ends; the decode instance is chosen then. Chunk-level: each chunk's KV as
  soon as that chunk ends, while the next chunk runs; the decode instance is chosen when the
  first chunk starts (the KV needs a destination), so only the last chunk's transfer (and any
  backlog on the link) follows the prefill. A request of one token needs no decode: no transfer.
- A decode instance queues arrived requests first come first served and admits the head while
  it has a stream slot and `admits` (the admission policy, on the low end of the prediction)
  says yes. Admitted streams decode in groups as the real scheduler forms them (planner.py), one
  group step at a time.
  KV capacity binds at admission only: a stream outliving its prediction keeps growing (no
  request is lost); how far past capacity that went is reported (`kv_overflow_peak`).
- Flips (optional): at each monitor tick, an idle instance with nothing in flight takes the
  role `flip` names; the last instance of a role never flips (requests would have nowhere to go).
- Busy time is prefill chunks and decode steps; transfers use the link, not the cores.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Protocol

from shardline.config import DEFAULT_PREFILL_CHUNK
from shardline.disagg.instance import Admission, FlipConfig, Running, admits, flip
from shardline.disagg.policies import (
    DEFAULT_PREFILL_BATCH,
    PrefillPolicy,
    Queued,
    chunks,
    dispatch,
    is_heavy,
    least_loaded_prefill,
    next_batch,
)
from shardline.disagg.state import ClusterState, DecodeLoad, LengthRange, PrefillLoad, Role, sent_decode, sent_prefill
from shardline.errors import ShardlineError
from shardline.serving.scheduler import SchedulerConfig
from shardline_tools.sim.costs import Costs
from shardline_tools.sim.planner import Finish, Hooks, Planner, Request, Step
from shardline_tools.sim.simulator import (
    MAX_ROWS,
    MAX_STREAMS,
    EventLoop,
    Flipped,
    Req,
    Server,
    SimResult,
    check_counts,
    requests,
    result,
)
from shardline_tools.sim.workloads import THRESHOLDS, RequestSpec

Predict = Callable[[RequestSpec], LengthRange]


class ByLength(Protocol):
    def predict(self, length: int) -> LengthRange: ...


def from_length(predictor: ByLength) -> Predict:
    """A `Predict` from an answer-from-the-true-length predictor (predictor.Oracle, NoisyOracle)."""
    return lambda spec: predictor.predict(spec.decode_tokens)


class Transfer(Enum):
    REQUEST = "request"  # the whole prompt's KV after the last chunk
    CHUNK = "chunk"  # each chunk's KV after that chunk, overlapping the next


@dataclass(frozen=True)
class DisaggConfig:
    prefill: int = 1
    decode: int = 1
    chunk: int = DEFAULT_PREFILL_CHUNK
    pad_chunks: bool = True  # the last chunk padded to `chunk` positions (policies.chunks)
    policy: PrefillPolicy = PrefillPolicy.FCFS
    batch: int = DEFAULT_PREFILL_BATCH
    transfer: Transfer = Transfer.REQUEST
    admission: Admission = Admission.VANILLA
    heavy_from: int = THRESHOLDS.heavy_decode[0]  # a decode predicted from here on is heavy
    monitor_period_s: float = 0.1  # TetriInfer's cluster monitor period
    groups: int = 1
    max_rows: int = MAX_ROWS
    max_streams: int = MAX_STREAMS  # streams a decode instance runs at once
    flip: FlipConfig | None = None  # None: roles are fixed
    seed: int = 0  # the dispatcher's power-of-two draws

    def __post_init__(self) -> None:
        check_counts(prefill=self.prefill, decode=self.decode, chunk=self.chunk, batch=self.batch,
                     heavy_from=self.heavy_from, groups=self.groups, max_rows=self.max_rows,
                     max_streams=self.max_streams)
        if not 0 < self.monitor_period_s < float("inf"):
            raise ShardlineError(f"simulator: the monitor period must be > 0 s, got {self.monitor_period_s}")


class _Cluster:
    """What every instance shares: the loop, costs, config, predictor, the monitor's snapshot."""

    def __init__(self, costs: Costs, cfg: DisaggConfig, predict: Predict) -> None:
        self.loop, self.costs, self.cfg, self.predict = EventLoop(), costs, cfg, predict
        self.rng = random.Random(cfg.seed)
        roles = [Role.PREFILL] * cfg.prefill + [Role.DECODE] * cfg.decode
        self.nodes = {f"i{k:03d}": _Node(f"i{k:03d}", role, self) for k, role in enumerate(roles)}
        self.snapshot = self._gather()
        self.flips: list[Flipped] = []
        self.kv_overflow_peak = 0
        self.unfinished = 0
        self.ticks = 0

    def _gather(self) -> ClusterState:
        return ClusterState({n.name: n.load() for n in self.nodes.values()})

    def arrive(self, r: Req) -> None:
        name = least_loaded_prefill(self.snapshot)
        self.snapshot = sent_prefill(self.snapshot, name, r.prompt)
        self.nodes[name].enqueue(r)

    def predicted(self, r: Req) -> LengthRange:
        got = self.predict(r.spec)
        if not isinstance(got, LengthRange):
            raise ShardlineError(f"simulator: the predictor returned {got!r:.60} for request {r.spec.index}, "
                                 "not a LengthRange")
        return got

    def destination(self, r: Req) -> _Node:
        assert r.predicted is not None  # predicted when its prefill started
        name = dispatch(self.snapshot, r.prompt, r.predicted, self.rng, self.cfg.heavy_from)
        heavy = is_heavy(r.predicted, self.cfg.heavy_from)
        self.snapshot = sent_decode(self.snapshot, name, r.prompt + r.predicted.lo, heavy)
        node = self.nodes[name]
        node.incoming += 1
        return node

    def tick(self) -> None:
        if self.cfg.flip is not None:
            self._flip(self.cfg.flip)
        self.snapshot = self._gather()  # after the flips: every decision sees roles as they are
        if not self.unfinished:
            return
        if not self.loop.pending():
            raise ShardlineError(f"simulator: {self.unfinished} requests can never finish (nothing left to run)")
        self.ticks += 1  # tick k at k periods exactly: no drift from adding the period again and again
        self.loop.at(self.ticks * self.cfg.monitor_period_s, self.tick)

    def _flip(self, cfg: FlipConfig) -> None:
        nodes = list(self.nodes.values())
        count = {role: sum(n.role is role for n in nodes) for role in (Role.PREFILL, Role.DECODE)}
        pressure = {role: sum(n.waiting_count() for n in nodes if n.role is role) / count[role] for role in count}
        for n in nodes:
            if not n.idle() or count[n.role] == 1:
                continue
            new = flip(n.role, self.loop.now - n.last_end, pressure, cfg, n.in_flight())
            if new is not None:
                count[n.role] -= 1
                count[new] += 1
                n.role, n.last_end = new, self.loop.now  # a fresh idle spell: no flip straight back
                self.flips.append(Flipped(self.loop.now, n.name, new))


class _Node(Server):
    """One instance in either role. Prefill side: its queue, current batch and link; decode side:
    arrived requests, running streams and groups. Only one side holds requests: a role changes
    only when nothing is in flight."""

    def __init__(self, name: str, role: Role, cluster: _Cluster) -> None:
        super().__init__(name, cluster.loop)
        self.role, self.c = role, cluster
        self.queue: dict[int, Req] = {}  # prefill: queued or prefilling, by index (arrival order)
        self.batch: deque[Req] = deque()  # prefill: the current batch's requests still to start
        self.current: Req | None = None  # prefill: the request being prefilled
        self.left: deque[int] = deque()  # prefill: the current request's chunks still to run
        self.target: _Node | None = None  # prefill, chunk-level: where the current request's KV goes
        self.link_free = 0.0  # when the outgoing link is next free
        self.incoming = 0  # decode: requests dispatched here whose KV has not landed
        self.waiting: deque[Req] = deque()  # decode: landed, not admitted
        self.streams: list[Req] = []  # decode: admitted streams
        scheduling = SchedulerConfig(chunk=cluster.cfg.chunk, groups=cluster.cfg.groups, max_rows=cluster.cfg.max_rows,
                                     pacing=None)
        self.planner = Planner(cluster.costs, scheduling, Hooks(self._never, self._ended, self._after))

    # --- what the monitor and the flip policy read

    def load(self) -> PrefillLoad | DecodeLoad:
        if self.role is Role.PREFILL:
            todo = sum(r.prompt - r.prefilled for r in self.queue.values())
            return PrefillLoad(len(self.queue), todo, self.running)
        heavy = sum(is_heavy(r.predicted, self.c.cfg.heavy_from) for r in self.streams if r.predicted)
        used = min(self._held(), self.c.costs.kv_tokens)
        return DecodeLoad(len(self.streams), heavy, len(self.streams) - heavy, used, self.c.costs.kv_tokens,
                          self.incoming + len(self.waiting))

    def waiting_count(self) -> int:
        """Requests waiting to start in this role (the flip policy's queue pressure)."""
        if self.role is Role.PREFILL:
            return sum(r is not self.current and not r.prefilled for r in self.queue.values())
        return len(self.waiting) + self.incoming

    def in_flight(self) -> int:
        return len(self.queue) + self.incoming + len(self.waiting) + len(self.streams)

    def _held(self) -> int:
        return sum(r.context for r in self.streams)

    def next_plan(self) -> list[Step]:
        return self._prefill_plan() if self.role is Role.PREFILL else self._decode_plan()

    # --- prefill side

    def enqueue(self, r: Req) -> None:
        self.queue[r.spec.index] = r
        self.wake()

    def _prefill_plan(self) -> list[Step]:
        if not self.left:
            if not self.batch and self.queue:
                # Batches run to their end before the next is drawn, so no queued request has started.
                queued = [Queued(r.spec.index, r.spec.index, r.prompt) for r in self.queue.values()]
                self.batch.extend(self.queue[q.id] for q in next_batch(queued, self.c.cfg.policy, self.c.cfg.batch))
            if not self.batch:
                return []
            self._begin(self.batch.popleft())
        assert self.current is not None  # set with `left` by _begin
        return [self._chunk(self.current, self.left.popleft())]

    def _begin(self, r: Req) -> None:
        self.current, self.left = r, deque(chunks(r.prompt, self.c.cfg.chunk))
        r.predicted = self.c.predicted(r)
        if self.c.cfg.transfer is Transfer.CHUNK and r.spec.decode_tokens > 1:
            self.target = self.c.destination(r)

    def _chunk(self, r: Req, n: int) -> Step:
        def start() -> tuple[float, Finish]:
            width = self.c.cfg.chunk if self.c.cfg.pad_chunks else n
            seconds = self.c.costs.prefill_s(width, r.prefilled)

            def finish(t: float) -> None:
                r.prefilled += n
                if self.c.cfg.transfer is Transfer.CHUNK and r.spec.decode_tokens > 1:
                    landed = self._send(n, t)
                    if r.prefilled == r.prompt:
                        assert self.target is not None  # chosen when its first chunk started
                        self._prefilled(r, t, self.target, landed)
                elif r.prefilled == r.prompt:
                    self._prefilled(r, t, None, t)

            return seconds, finish

        return start

    def _prefilled(self, r: Req, t: float, target: _Node | None, landed: float) -> None:
        """`r`'s last chunk ended at `t`: its first token is out; its KV lands on `target` at
        `landed` (request-level: dispatched and sent now)."""
        del self.queue[r.spec.index]
        self.current, self.target = None, None
        if r.first_token(t):
            self.c.unfinished -= 1
            return
        if target is None:
            target, landed = self.c.destination(r), self._send(r.prompt, t)
        self.c.loop.at(landed, partial(target.land, r))

    def _send(self, tokens: int, t: float) -> float:
        """KV of `tokens` tokens onto the link at `t` (behind what it is sending): when it lands."""
        start = max(t, self.link_free)
        self.link_free = start + self.c.costs.transfer_s(self.c.costs.kv_bytes(tokens))
        return self.link_free

    # --- decode side

    def land(self, r: Req) -> None:
        self.incoming -= 1
        self.waiting.append(r)
        self._admit()
        self.wake()

    def _admit(self) -> None:
        cfg = self.c.cfg
        while self.waiting and len(self.streams) < cfg.max_streams:
            head = self.waiting[0]
            assert head.predicted is not None
            running = [Running(x.prompt, x.generated, x.predicted) for x in self.streams if x.predicted]
            load = self.load()
            assert isinstance(load, DecodeLoad)
            if not admits(cfg.admission, load, head.predicted, head.prompt, running):
                if not self.streams:
                    raise ShardlineError(f"simulator: request {head.spec.index} can never start on {self.name}: "
                                         f"prompt {head.prompt} + predicted {head.predicted.lo} tokens do not fit "
                                         f"its {self.c.costs.kv_tokens} KV tokens under {cfg.admission.value}")
                return
            self.streams.append(self.waiting.popleft())
            self.planner.adopt(head.spec.index, head, head.spec.decode_tokens, head.generated)

    def _decode_plan(self) -> list[Step]:
        return self.planner.plan()

    def _never(self, r: Request) -> None:
        raise ShardlineError("simulator: a decode instance prefilled a prompt")

    def _ended(self, r: Request) -> None:
        assert isinstance(r, Req)
        self.streams.remove(r)
        self.c.unfinished -= 1

    def _after(self) -> None:
        excess = self._held() - self.c.costs.kv_tokens
        self.c.kv_overflow_peak = max(self.c.kv_overflow_peak, excess)
        self._admit()


def simulate_disaggregated(specs: Sequence[RequestSpec], costs: Costs, predict: Predict,
                           cfg: DisaggConfig | None = None) -> SimResult:
    """Every request served by prefill and decode instances (module docstring: the model)."""
    cluster = _Cluster(costs, cfg or DisaggConfig(), predict)
    reqs = requests(specs)
    cluster.unfinished = len(reqs)
    cluster.loop.at(0.0, cluster.tick)  # first: arrivals at t = 0 see a gathered state
    for r in reqs:
        cluster.loop.at(r.spec.arrival_s, partial(cluster.arrive, r))
    cluster.loop.run()
    return result(reqs, cluster.nodes.values(), max(0, cluster.kv_overflow_peak), cluster.flips)
