"""What a pipeline executes: step plans made by the scheduler (serving/scheduler.py), and what
comes back. A pipeline decides nothing: it runs each step through its stages in the order it
was submitted and posts one `Outcome` per row.

Two kinds of step, distinct in the types:
- `PrefillStep`: a chunk of one stream's prompt. The first chunk opens the stream's request on
  every stage (an empty cache); the last chunk samples the first generated token.
- `DecodeStep`: generated and drafted tokens of one stream or of a decode group's rows, each
  row with the same number of new tokens (a row with fewer is padded with masked ones). Before
  running, every stage keeps the rows `keep` of the group's state and appends the `merge`
  streams' own states (joins), or compacts the state (drops its masked slots).

Every step names the positions whose next token is wanted (`sample_at`, (row, t) pairs): the
last stage computes logits for those alone and the sampler chooses a token at each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, NewType, Protocol

import numpy as np

from shardline.config import SamplingParams
from shardline.decoding.masks import LateMasks, TokenMasks
from shardline.decoding.sampler import Choice
from shardline.decoding.speculative import Drafted
from shardline.errors import ShardlineError
from shardline.pipeline.hidden import HiddenChunk
from shardline.pipeline.kv import KvSnapshot, StageLayout, check
from shardline.pipeline.ragged_step import RaggedStep
from shardline.pipeline.timing import Timing
from shardline.stage.cache import KVBook, StepInputs
from shardline.stage.work import StageWork
from shardline.wire.messages import Phase

# Identity and state are apart: a stream keeps its id for life (its outcomes name it), while the
# KV state it runs on is a lease, a key every stage holds state under: the stream's own, or its
# decode group's (negative). A replay or a move to another instance takes a new lease.
StreamId = NewType("StreamId", int)
Lease = NewType("Lease", int)


@dataclass(frozen=True)
class Step:
    key: int  # the lease every stage holds this step's KV under: the stream's own, or its group's
    streams: tuple[int, ...]  # the stream of each row (StreamId)
    sampling: tuple[SamplingParams, ...]  # per row
    inputs: StepInputs
    sample_at: np.ndarray  # [E, 2] i64: (row, t) whose next token is wanted, rows in order
    want_logits: bool = False
    made: float = field(default_factory=time.perf_counter, compare=False)  # when it was planned
    masks: TokenMasks | LateMasks | None = None  # allowed tokens per sampled entry (constrained rows only)
    phase: ClassVar[Phase]

    def __post_init__(self) -> None:
        b = self.inputs.rows
        if len(self.streams) != b or len(self.sampling) != b:
            raise ShardlineError(f"a step of {b} rows needs a stream and a sampling per row")

    def entries(self, row: int) -> int:
        """How many tokens row `row` asks for."""
        return int((self.sample_at[:, 0] == row).sum())

    def work(self) -> StageWork:
        """What every stage does for this step (stage/work.py)."""
        raise NotImplementedError


@dataclass(frozen=True)
class PrefillStep(Step):
    first: bool = True  # the stream's first chunk: every stage opens a fresh request for it
    phase: ClassVar[Phase] = Phase.PREFILL

    def work(self) -> StageWork:
        return StageWork(self.key, self.inputs, self.sample_at, self.sampling, first=self.first,
                         want_logits=self.want_logits, masks=self.masks)


@dataclass(frozen=True)
class DecodeStep(Step):
    keep: tuple[int, ...] = ()  # rows of the key's state kept, in order (empty: all, as they are)
    merge: tuple[int, ...] = ()  # the leases of the streams whose own state is appended after the kept rows
    # Before running, every stage drops the slots the inputs' mask (given over the cache as it
    # is) never attends again; the step then runs over the compacted cache (StepInputs.compacted).
    compact: bool = False
    drafted: Drafted | None = None  # drafts drawn from distributions, per sampled entry
    phase: ClassVar[Phase] = Phase.DECODE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compact and (self.keep or self.merge or self.inputs.beam_idx is not None):
            raise ShardlineError("a step that merges or drops rows cannot also compact")

    def work(self) -> StageWork:
        return StageWork(self.key, self.inputs, self.sample_at, self.sampling, keep=self.keep, merge=self.merge,
                         compact=self.compact, want_logits=self.want_logits, drafted=self.drafted,
                         masks=self.masks)


def _started() -> Future[Any]:
    """A Future no one can cancel: its item is on its way to the stages."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass(frozen=True)
class Release:
    """A lease's state freed on every stage, after every step submitted before it."""

    lease: int


@dataclass(frozen=True, eq=False)
class KvExport:
    """A lease's KV out of every stage, from slot `start` on (the lease stays open), after every
    step submitted before it; what came out (or why not: ShardlineError) lands in `done`. On a
    paged pipeline (issue 41) a stream's `blocks` instead: the KV of their first `tokens`
    tokens, as one row of that many slots (the snapshot does not depend on the block size),
    the stream's slots from `start` on (the first block's first token: a chunk's slice)."""

    lease: int
    start: int = 0
    done: Future[KvSnapshot] = field(default_factory=_started)
    blocks: tuple[int, ...] = ()
    tokens: int = 0


@dataclass(frozen=True, eq=False)
class KvImport:
    """A fresh lease opened on every stage with `snap`'s state, before every step submitted
    after it; `done` says when it is in (or why not: ShardlineError, the lease closed everywhere)."""

    lease: int
    snap: KvSnapshot
    done: Future[None] = field(default_factory=_started)
    made: float = field(default_factory=time.perf_counter, compare=False)  # as a step's
    blocks: tuple[int, ...] = ()  # a paged pipeline's: the blocks the snapshot's slots go into


@dataclass(frozen=True, eq=False)
class KvCopy:
    """A fresh lease `dst` opened on every stage with the slots `index` (in order) of row `row`
    of `src`'s state, after every step submitted before it (`src` stays as it is): prefix reuse
    (serving/prefix.py) keeps an ended stream's attended slots so, and starts a new stream from
    an entry's first slots so. `done` says when it is in on every stage (or why not:
    ShardlineError, `dst` closed everywhere)."""

    src: int
    dst: int
    index: np.ndarray  # [W] i64, slots of `src`
    row: int = 0
    done: Future[None] = field(default_factory=_started)

    @property
    def lease(self) -> int:  # the lease it opens (as an import's)
        return self.dst


KvMove = KvExport | KvImport | KvCopy
# What a pipeline runs: a keyed step (stateful and static stages), or a paged pipeline's ragged
# step (pipeline/ragged_step.py: every stream's tokens in one flat batch over block tables).
AnyStep = Step | RaggedStep


def unfit(item: KvMove, identity: str, layout: Callable[[], list[StageLayout]], paged: bool = False) -> bool:
    """Whether `item` is an import whose snapshot another export made or that does not fit
    `layout`, or a move by blocks on a pipeline that is not `paged` (or by lease on one that
    is): then its `done` fails here, before any stage sees it."""
    if (isinstance(item, KvExport | KvImport) and bool(item.blocks)) != paged:
        why = "a paged pipeline moves KV by blocks only" if paged else "KV blocks move on a paged pipeline only"
        item.done.set_exception(ShardlineError(why))
        return True
    if isinstance(item, KvImport):
        try:
            check(item.snap, identity, layout())
        except ShardlineError as e:
            item.done.set_exception(e)
            return True
    return False


@dataclass(frozen=True)
class Plan:
    """One round's stage work, in the order a pipeline takes it: KV exports and copies, the
    leases released, KV imports, then the steps. (A stream leaving this instance has its KV
    exported, an ended stream's kept, before its lease is released, and an evicted entry is
    copied from before it goes; a group emptied this round may be re-entered by this round's
    steps, a joiner merged into its lease: a release after that merge would free the new state;
    an imported or copied lease is open before any step runs on it.)"""

    releases: tuple[int, ...] = ()
    steps: tuple[AnyStep, ...] = ()
    exports: tuple[KvExport, ...] = ()
    imports: tuple[KvImport, ...] = ()
    copies: tuple[KvCopy, ...] = ()


def execute(pipe: Pipeline, plan: Plan, failed: Callable[[AnyStep, str], None]) -> None:
    """Hand `plan` to `pipe` in its order; a step that cannot start fails its rows (`failed`),
    a KV move that cannot start fails its `done`."""
    for x in plan.exports:
        _move(pipe, x)
    for c in plan.copies:
        _move(pipe, c)
    for key in plan.releases:
        pipe.release(key)
    for y in plan.imports:
        _move(pipe, y)
    for step in plan.steps:
        try:
            pipe.submit(step)
        except Exception as e:  # noqa: BLE001 - a step that cannot start fails its streams
            failed(step, f"{type(e).__name__}: {e}")
    for step in plan.steps:  # the grammars' masks, while the steps run (decoding/masks.LateMasks)
        if isinstance(step.masks, LateMasks):
            step.masks.prepare()


def _move(pipe: Pipeline, item: KvMove) -> None:
    try:
        pipe.move(item)
    except Exception as e:  # noqa: BLE001 - a move that cannot start fails its own future alone
        if not item.done.done():
            item.done.set_exception(e)


def export_kv(pipe: Pipeline, key: int, start: int = 0) -> Future[KvSnapshot]:
    """`key`'s KV from slot `start` on, out of `pipe` now (in order with the steps submitted)."""
    pipe.move(x := KvExport(key, start))
    return x.done


def import_kv(pipe: Pipeline, key: int, snap: KvSnapshot) -> Future[None]:
    """`snap` into `pipe` under the fresh `key` now (in order with the steps submitted)."""
    pipe.move(y := KvImport(key, snap))
    return y.done


@dataclass(frozen=True)
class Outcome:
    """What came back for one row of a step: a choice per position it asked for (none for a
    prompt chunk that is not the last), or why the step failed. A step is `lost` when it failed
    because the pipeline broke under it (a link lost, a worker that stopped answering, or its
    state gone with a chain that broke): the request may be replayed on the repaired pipeline.
    A step a stage refused (it does not fit) is not lost: it fails its request."""

    stream: int
    choices: tuple[Choice, ...] = ()
    error: str = ""
    timing: Timing | None = None
    lost: bool = False
    hidden: HiddenChunk | None = None  # a prefill chunk's stage-0 summary, from a summarizing pipeline


    @property
    def failed(self) -> bool:
        return bool(self.error)


@dataclass(frozen=True, eq=False)
class Moved:
    """A plan's KV move finished (issue 41 point 5): what came out, or why not, is in its
    `done`, which is complete when this arrives. Comes out of `outcomes` beside the steps'
    Outcomes: a move's result is taken when it lands, never polled for on later rounds."""

    item: KvMove


@dataclass(frozen=True)
class Placed:
    """Where a run of stages runs and whether it is up (the fleet page's chain, api/fleet.py)."""

    first_layer: int
    last_layer: int
    where: str  # "this process", or a worker's HOST:PORT
    up: bool = True
    why: str = ""  # why it is down
    device: str = ""  # the OpenVINO device(s) it runs on ("" when not known)


class Pipeline(Protocol):
    """Runs step plans through every stage; one Outcome per row comes out of `outcomes`."""

    n_stages: int
    context: int  # the longest sequence it serves (RunConfig.context resolved; every stage agrees)

    # The plan's items, each in order with the others (pipeline/kv.py for what a KV move holds);
    # a move's result or error lands in its `done`, and a Moved for it comes out of `outcomes`.
    def submit(self, step: AnyStep) -> None: ...
    def release(self, key: int) -> None: ...
    def move(self, item: KvMove) -> None: ...
    def outcomes(self, timeout: float | None = None) -> list[Outcome | Moved]: ...
    def wake(self) -> None: ...  # a caller's message waits: end an `outcomes` wait now
    def idle(self) -> bool: ...  # no graph work of this pipeline runs or waits on this machine
    def shutdown(self) -> None: ...
    def placement(self) -> list[Placed]: ...  # in chain order, from stage 0 (any thread)
    def layout(self) -> list[StageLayout]: ...  # each stage's layers and KV variables


def reserve(step: Step, books: Sequence[KVBook]) -> None:
    """`step` is about to be sent: each row's book takes the step's mask row (the step's cache
    from then on, compacted first if it compacts; a row's left padding included) and advances
    its position. The one place books are committed; a rejected draft is masked back out when
    its outcome is applied (the engine's speculation)."""
    if len(books) != step.inputs.rows:
        raise ShardlineError(f"a step of {step.inputs.rows} rows needs a book per row, got {len(books)}")
    kept = step.inputs.compacted()[1] if isinstance(step, DecodeStep) and step.compact else step.inputs
    for row, book in enumerate(books):
        book.commit(kept, row)


def prefill_step(stream: int, book: KVBook, tokens: list[int], params: SamplingParams, *, first: bool,
                 last: bool, want_logits: bool = False, key: int | None = None,
                 masks: TokenMasks | LateMasks | None = None) -> PrefillStep:
    """A prompt chunk of `stream` on its lease `key` (None: the stream's id), over its book as
    it is (not committed: `reserve`); the last chunk samples the token after its last position."""
    at = np.array([[0, len(tokens) - 1]] if last else np.zeros((0, 2)), np.int64)
    return PrefillStep(stream if key is None else key, (stream,), (params,), book.plan(tokens), at, want_logits,
                       masks=masks if last else None, first=first)


def decode_step(stream: int, book: KVBook, tokens: list[int], params: SamplingParams, *, sample_all: bool = False,
                want_logits: bool = False, compact: bool = False, drafted: Drafted | None = None,
                key: int | None = None, masks: TokenMasks | LateMasks | None = None) -> DecodeStep:
    """`tokens` fed to one stream on its own state (lease `key`; None: the stream's id), over
    its book as it is (not committed: `reserve`): the next token after the last (or, with
    `sample_all`, after each of them, as a verify step needs); `compact` first drops the cache's
    masked slots."""
    ts = range(len(tokens)) if sample_all else [len(tokens) - 1]
    at = np.array([[0, t] for t in ts], np.int64)
    return DecodeStep(stream if key is None else key, (stream,), (params,), book.plan(tokens), at, want_logits,
                      masks=masks, compact=compact, drafted=drafted)


def prefill(stream: int, book: KVBook, tokens: list[int], params: SamplingParams, *, first: bool,
            last: bool, want_logits: bool = False, key: int | None = None) -> PrefillStep:
    """`prefill_step`, reserved at once (one stream's steps by hand: tests, benchmarks)."""
    step = prefill_step(stream, book, tokens, params, first=first, last=last, want_logits=want_logits, key=key)
    reserve(step, [book])
    return step


def decode(stream: int, book: KVBook, tokens: list[int], params: SamplingParams, *, sample_all: bool = False,
           want_logits: bool = False, compact: bool = False, drafted: Drafted | None = None,
           key: int | None = None) -> DecodeStep:
    """`decode_step`, reserved at once (one stream's steps by hand: tests, benchmarks)."""
    step = decode_step(stream, book, tokens, params, sample_all=sample_all, want_logits=want_logits, compact=compact,
                       drafted=drafted, key=key)
    reserve(step, [book])
    return step


def run(pipe: Pipeline, step: Step, timeout: float | None = 600.0) -> list[Outcome]:
    """Submit `step` and wait for its rows (for a caller that is the pipeline's only consumer:
    tests, benchmarks; the engine instead takes outcomes as they come)."""
    pipe.submit(step)
    want, got = set(step.streams), dict[int, Outcome]()
    deadline = None if timeout is None else time.monotonic() + timeout
    while want - got.keys():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        outs = pipe.outcomes(left)
        if not outs and left == 0.0:
            raise ShardlineError(f"no result for step of key {step.key} within {timeout} s")
        got.update({o.stream: o for o in outs if isinstance(o, Outcome) and o.stream in want})
    return [got[s] for s in step.streams]
