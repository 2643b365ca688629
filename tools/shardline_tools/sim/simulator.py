"""A discrete-event simulator of serving on `Costs`: coupled instances here, disaggregated ones in
simulator_disagg.py. Pure: no processes, no clock, deterministic for its inputs (and seed).

Time model, common to both modes:
- An instance runs one step at a time: a prefill chunk or one decode group's step. Stages sharing
  a machine's cores run a step's graphs one after another (BENCHMARKS.md, issue 9 prefill (a):
  chunks in flight together gained 0.92-1.07x), so steps queued on an instance serialize.
- A prefill chunk of n positions after c cached tokens costs `Costs.prefill_s(n, c)`.
- A decode step charges `Costs.decode_s(R, w)`: R the group's rows, w the width of its state (the
  token fed now included). A group's rows are left-padded to the widest (serving/groups.py), and
  the state only grows, one slot per step, until it is compacted: when the widest row has left,
  w stays until it exceeds the widest live row by COMPACT_AT slots. A step that merges joiners
  into kept rows (or more than one joiner into an empty group) adds `Costs.merge_s(R, w)`; one
  that drops departed rows, or compacts, adds `Costs.drop_s(R, w)` (the engine's regrouping
  copies, which grow with the whole state). Every row's next token comes out at the step's end.
- A request's first token is sampled by its last prefill chunk and reaches the client at that
  chunk's end; a request of one token ends there. Each later token costs one decode step.
- An instance plans its next steps when its last planned step ends, or, when idle, once every
  event of the instant new work came has run (requests arriving together are planned together).

Coupled serving (the baseline, the real engine's policy, serving/scheduler.py): a new request goes
to the instance with the fewest active + queued requests (the lowest index on a tie); an instance
admits up to `max_streams` (the rest wait, first come first served), and only while the head's
prompt fits the KV tokens it has (`Costs.kv_tokens`) beside what its admitted requests hold (a
prefilling one its prompt, a decoding one its context): the vanilla admission a decode instance
uses, so both modes run on the same memory. As there, a stream outgrowing the capacity is never
evicted, and how far past it went is reported (`kv_overflow_peak`). Each iteration runs the real
`KeyedScheduler.plan()` (planner.py: the instance's requests are real streams): one step of every
decode group, then one chunk of each of the `max_prefills` oldest prompts, with fixed chunks; its
steps run in that order, and the next iteration is planned when the last ends. So a long
prompt's chunks sit between a running stream's tokens: the interference disaggregation removes.
A prefilled stream joins the decode group with the fewest members (a new group when all have
`max_rows`) and decodes from the next iteration.

The real scheduler's rows are fixed when a round is planned. The simulator's own copy of its
groups (before issue 24) read a group's rows when its step started, so on a decode instance a
stream that landed mid-round rode a step planned before it: disaggregated figures moved by up to
a few seconds on 120-request workloads (coupled ones are identical to the copy's).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType

from shardline.config import DEFAULT_PREFILL_CHUNK
from shardline.disagg.state import LengthRange, Role
from shardline.errors import ShardlineError
from shardline.serving.groups import MAX_ROWS as ENGINE_MAX_ROWS
from shardline.serving.scheduler import SchedulerConfig
from shardline_tools.sim.costs import Costs
from shardline_tools.sim.metrics import Interval, RequestRecord, Slo, Summary, summarize
from shardline_tools.sim.planner import Hooks, Planner, Request, Step
from shardline_tools.sim.workloads import RequestSpec

# The real engine's defaults, imported (serving/ is pure: it loads no OpenVINO).
MAX_ROWS = ENGINE_MAX_ROWS  # rows per decode group
MAX_PREFILLS = SchedulerConfig().max_prefills  # prompts prefilling at once
# Streams an instance holds: what `shardline serve` allows on this 24 GiB machine at the 8192-token
# context (BENCHMARKS.md, "What the serving engine does with this": 30 streams).
MAX_STREAMS = 30



class EventLoop:
    """Callbacks at simulated times; equal times run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()  # the tie-break that makes a run deterministic

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if not t >= self.now:  # also refuses NaN
            raise ShardlineError(f"simulator: an event at {t} s scheduled at {self.now} s (time runs forward)")
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def pending(self) -> int:
        return len(self._heap)

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass(eq=False)
class Req:
    """One request's progress. Invariant: 0 <= generated <= decode_tokens; first_s then finish_s
    are set once each, in that order."""

    spec: RequestSpec
    prefilled: int = 0
    generated: int = 0  # tokens generated, the first one included
    first_s: float | None = None
    finish_s: float | None = None
    predicted: LengthRange | None = None  # disaggregated only

    @property
    def prompt(self) -> int:
        return self.spec.prompt_tokens

    @property
    def context(self) -> int:
        """Positions its next decode step attends over: the prompt and every token so far."""
        return self.prompt + self.generated

    def first_token(self, t: float) -> bool:
        """The last prefill chunk sampled the first token at `t`; True when that ends the request."""
        if self.first_s is not None or self.prefilled != self.prompt:
            raise ShardlineError(f"simulator: request {self.spec.index} got a first token twice or early")
        self.first_s = t
        return self.advance(t)

    def advance(self, t: float) -> bool:
        """One more token at `t`; True when it was the last (the request finishes then)."""
        if self.finish_s is not None:
            raise ShardlineError(f"simulator: request {self.spec.index} stepped after it finished")
        self.generated += 1
        if self.generated == self.spec.decode_tokens:
            self.finish_s = t
        return self.finish_s is not None

    def record(self) -> RequestRecord:
        if self.first_s is None or self.finish_s is None:
            raise ShardlineError(f"simulator: request {self.spec.index} never finished")
        return RequestRecord(self.spec.arrival_s, self.first_s, self.finish_s, self.generated)


class Server:
    """An instance's cores: runs its planned steps one at a time; plans again when they run out.
    Subclasses say what to run (`next_plan`) and call `kick` when new work may have come."""

    def __init__(self, name: str, loop: EventLoop) -> None:
        self.name = name
        self.loop = loop
        self.busy: list[Interval] = []
        self.running = False  # a step is in flight
        self.last_end = 0.0  # when the last step ended: the start of the current idle spell
        self._plan: deque[Step] = deque()
        self._woken = False  # a kick is scheduled for this instant

    def next_plan(self) -> list[Step]:
        raise NotImplementedError

    def idle(self) -> bool:
        return not self.running and not self._plan

    def wake(self) -> None:
        """New work came from outside: plan once every event of this instant has run, so that
        requests arriving together are planned together (as one engine round would take them)."""
        if not self._woken:
            self._woken = True
            self.loop.at(self.loop.now, self._woken_kick)

    def _woken_kick(self) -> None:
        self._woken = False
        self.kick()

    def kick(self) -> None:
        if self.running:
            return
        if not self._plan:
            self._plan.extend(self.next_plan())
        if not self._plan:
            return
        seconds, finish = self._plan.popleft()()
        start, self.running = self.loop.now, True

        def done() -> None:
            self.busy.append((start, self.loop.now))
            finish(self.loop.now)  # a kick from inside it waits: the effect is applied whole first
            self.running, self.last_end = False, self.loop.now
            self.kick()

        self.loop.at(start + seconds, done)


@dataclass(frozen=True)
class Flipped:
    time_s: float
    instance: str
    role: Role  # the role it took


@dataclass(frozen=True)
class SimResult:
    records: tuple[RequestRecord, ...]  # one per request, in the order of the specs given
    busy: Mapping[str, tuple[Interval, ...]]  # each instance's steps (KV transfers are not busy time)
    instances: int
    kv_overflow_peak: int = 0  # most KV tokens a decode instance held past its capacity at once
    flips: tuple[Flipped, ...] = field(default=())

    def summary(self, slo: Slo) -> Summary:
        return summarize(self.records, self.busy, self.instances, slo)


def requests(specs: Sequence[RequestSpec]) -> list[Req]:
    if not specs:
        raise ShardlineError("simulator: no requests to simulate")
    if len({s.index for s in specs}) != len(specs):
        raise ShardlineError("simulator: two requests share an index")
    return [Req(s) for s in specs]


def result(reqs: Sequence[Req], servers: Iterable[Server], kv_overflow_peak: int = 0,
           flips: Sequence[Flipped] = ()) -> SimResult:
    servers = list(servers)
    busy = MappingProxyType({s.name: tuple(s.busy) for s in servers})
    return SimResult(tuple(r.record() for r in reqs), busy, len(servers), kv_overflow_peak, tuple(flips))


def check_counts(**counts: int) -> None:
    wrong = {k: v for k, v in counts.items() if v < 1}
    if wrong:
        raise ShardlineError(f"simulator: these must be >= 1: {wrong}")


@dataclass(frozen=True)
class CoupledConfig:
    instances: int = 2
    chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill step (no padding, as the engine)
    max_prefills: int = MAX_PREFILLS
    groups: int = 1  # decode groups an instance starts with (the in-process default)
    max_rows: int = MAX_ROWS
    max_streams: int = MAX_STREAMS

    def __post_init__(self) -> None:
        check_counts(instances=self.instances, chunk=self.chunk, max_prefills=self.max_prefills,
                     groups=self.groups, max_rows=self.max_rows, max_streams=self.max_streams)


class _Coupled(Server):
    def __init__(self, name: str, loop: EventLoop, costs: Costs, cfg: CoupledConfig) -> None:
        super().__init__(name, loop)
        self.costs, self.cfg = costs, cfg
        self.queue: deque[Req] = deque()  # not admitted yet (the stream limit)
        self.prefilling: list[Req] = []  # admitted, in admission order: the oldest prefill first
        self.decoding: list[Req] = []  # prefilled, in a decode group
        self.kv_overflow_peak = 0  # most KV tokens held past the capacity at once
        scheduling = SchedulerConfig(chunk=cfg.chunk, groups=cfg.groups, max_rows=cfg.max_rows,
                                     max_prefills=cfg.max_prefills, pacing=None)
        self.planner = Planner(costs, scheduling, Hooks(self._prefilled, self._ended, self._after))

    def load(self) -> int:
        return len(self.queue) + len(self.prefilling) + len(self.decoding)

    def offer(self, r: Req) -> None:
        self.queue.append(r)
        self._admit()
        self.wake()

    def _held(self) -> int:
        """KV tokens the admitted requests hold: a prefilling prompt's whole KV is reserved."""
        return sum(r.prompt for r in self.prefilling) + sum(r.context for r in self.decoding)

    def _admit(self) -> None:
        while self.queue and len(self.prefilling) + len(self.decoding) < self.cfg.max_streams:
            head = self.queue[0]
            if head.prompt > self.costs.kv_tokens - self._held():
                if not self.prefilling and not self.decoding:
                    raise ShardlineError(f"simulator: request {head.spec.index} can never start on {self.name}: "
                                         f"its prompt of {head.prompt} tokens does not fit its "
                                         f"{self.costs.kv_tokens} KV tokens")
                return
            self.prefilling.append(self.queue.popleft())
            self.planner.add(head.spec.index, head, head.spec.decode_tokens)

    def next_plan(self) -> list[Step]:
        return self.planner.plan()

    def _prefilled(self, r: Request) -> None:
        assert isinstance(r, Req)
        self.prefilling.remove(r)
        self.decoding.append(r)

    def _ended(self, r: Request) -> None:
        assert isinstance(r, Req)
        (self.decoding if r in self.decoding else self.prefilling).remove(r)
        self._admit()

    def _after(self) -> None:
        self.kv_overflow_peak = max(self.kv_overflow_peak, self._held() - self.costs.kv_tokens)


def simulate_coupled(specs: Sequence[RequestSpec], costs: Costs, cfg: CoupledConfig | None = None) -> SimResult:
    """Every request served by coupled instances (module docstring: the policy and the timing)."""
    cfg = cfg or CoupledConfig()
    reqs, loop = requests(specs), EventLoop()
    instances = [_Coupled(f"c{i:03d}", loop, costs, cfg) for i in range(cfg.instances)]

    def arrive(r: Req) -> None:
        min(instances, key=lambda x: (x.load(), x.name)).offer(r)

    for r in reqs:
        loop.at(r.spec.arrival_s, partial(arrive, r))
    loop.run()
    return result(reqs, instances, max(0, *(x.kv_overflow_peak for x in instances)))
