"""A request's constraint (response_format, json_schema, grammar, tools) compiled before anything is
queued: a schema or grammar the engine cannot compile, or will not (over a cap, over the time
limit, one no output can complete: model/grammar.py), is a 400 naming the field.

Compiles run on their own threads (issue 54), a bounded number at a time at the lowest CPU
priority and paced to a quarter of one core (SHARE), so hostile schemas cannot take the cores
the engine steps on: a compile waits for a thread and its turn, and past MAX_WAITING waiting ones
the request is a 429 with Retry-After. What bounds a
compile's CPU is the caps and llguidance's limits (model/schema_caps.py, grammar_probe.py); the
time limit is checked between llguidance's calls, and here, on the thread's CPU clock, so the
client has its 400 at the limit even while one call that cannot be interrupted runs on: its
thread stays taken (and counted) until it returns, then the refusal is cached for the spec."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from shardline.api.metrics import ServerMetrics
from shardline.api.schemas import ApiError
from shardline.model.grammar import COMPILE_CPU_S, GrammarError, Grammars, GrammarSpec, over_time
from shardline.serving.engine import Constraint

T = TypeVar("T")
Wanted = tuple[GrammarSpec | Callable[[Grammars], Constraint], str]  # what constrains, and its field

COMPILERS = 1  # threads compiling at once: one core of a 2-core PC at most, at nice 19
# Of one core, what compiles may take on average: after a compile that took c seconds of CPU the
# next starts c * (1 / SHARE - 1) later. Nice alone was not enough: a nice-19 process compiling
# without pause beside the engine still slowed plain streams 1.34x on 2 cores (BENCHMARKS.md).
SHARE = 0.25
MAX_WAITING = 8  # compiles waiting for a thread (a timed-out one still running counts) before 429s
WALL_S = 60.0  # how long a request waits for its compile at all (a thread starved by the engine)
SLACK_S = 0.5  # past the limit, before the wait gives up: the thread's own check says it first when it can
POLL_S = 0.05


class Compiles:
    """The compile threads, and how many compiles they hold (running or waiting)."""

    def __init__(self, threads: int = COMPILERS, waiting: int = MAX_WAITING, cpu_s: float = COMPILE_CPU_S,
                 retry_after_s: int = 1, share: float = SHARE) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar", initializer=_background)
        self._bound, self.cpu_s, self.retry_after_s = threads + waiting, cpu_s, retry_after_s
        self._pace = _Pace(share)
        self._lock = threading.Lock()
        self.held = 0  # compiles submitted and not returned, a timed-out one included

    async def run(self, work: Callable[[], T], param: str, prepare: Callable[[], object] = lambda: None) -> T:
        """`work()` on a compile thread, after `prepare()` (not timed: what every compile shares,
        built once); ApiError 429 when too many wait, GrammarError once `work` has taken `cpu_s`
        of its thread's CPU time."""
        with self._lock:
            if self.held >= self._bound:
                raise ApiError(429, f"{param}: too many grammars are compiling, retry later", "server_error",
                               param=param, code="overloaded", headers={"Retry-After": str(self.retry_after_s)})
            self.held += 1
        job = _Job(work, prepare, self._pace)
        future = self._pool.submit(job)
        future.add_done_callback(self._returned)
        return await self._awaited(job, future)

    async def _awaited(self, job: _Job[T], future: Future[T]) -> T:
        waiting, start = asyncio.wrap_future(future), time.monotonic()
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=POLL_S)
            if done:
                return waiting.result()
            if job.cpu_s() > self.cpu_s + SLACK_S:
                raise GrammarError(over_time(self.cpu_s))
            if time.monotonic() - start > WALL_S:
                raise ApiError(503, "the grammar could not be compiled in time, retry later", "server_error",
                               code="overloaded", headers={"Retry-After": str(self.retry_after_s)})

    def _returned(self, _: Future[T]) -> None:
        with self._lock:
            self.held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Pace:
    """Compiles' CPU held to `share` of one core on average (see SHARE)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self._clock, self._next, self._lock = share, clock, 0.0, threading.Lock()

    def delay(self) -> float:
        """Seconds until the next compile may start."""
        with self._lock:
            return max(0.0, self._next - self._clock())

    def wait(self) -> None:
        if (delay := self.delay()) > 0:
            time.sleep(delay)

    def spent(self, cpu_s: float) -> None:
        with self._lock:
            self._next = max(self._next, self._clock()) + cpu_s * (1 / self.share - 1)


class _Job(Generic[T]):
    """One compile, and the CPU clock of the thread running it (read from the event loop)."""

    def __init__(self, work: Callable[[], T], prepare: Callable[[], object], pace: _Pace) -> None:
        self._work, self._prepare, self._pace = work, prepare, pace
        self._clock: int | None = None  # the thread's CPU clock (Linux's are negative numbers)
        self._start = 0.0

    def __call__(self) -> T:
        self._pace.wait()
        start = time.thread_time()
        try:
            self._prepare()
            with contextlib.suppress(AttributeError, OSError):  # a thread's clock: Linux and most Unixes
                self._start = time.clock_gettime(clock := time.pthread_getcpuclockid(threading.get_ident()))
                self._clock = clock
            return self._work()
        finally:
            self._pace.spent(time.thread_time() - start)

    def cpu_s(self) -> float:
        """CPU seconds the job has taken so far (0 before it starts, or without thread clocks)."""
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock) - self._start
        except OSError:
            return 0.0


def _background() -> None:
    """A compile thread runs at the lowest priority (Linux: `nice` applies per thread), so the
    engine's threads take the cores first."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


async def constrain(grammars: Grammars | None, compiles: Compiles, wanted: Wanted | None,
                    metrics: ServerMetrics) -> Constraint | None:
    """`wanted`'s constraint: a spec's matcher, or what a callable builds (tools' lazy grammar)."""
    if wanted is None:
        return None
    grammar, param = wanted
    if grammars is None:
        raise ApiError(400, f"{param}: constrained output is not available on this server", param=param,
                       code="unsupported_parameter")
    before = grammars.compile_s
    build = (lambda: grammars.constraint(grammar)) if isinstance(grammar, GrammarSpec) else (lambda: grammar(grammars))
    try:
        constraint = await compiles.run(build, param, prepare=grammars.words)
    except GrammarError as e:
        raise ApiError(400, f"{param}: cannot be compiled into a grammar: {str(e)[:500]}", param=param) from None
    metrics.constrained(grammars.compile_s - before)
    return constraint
