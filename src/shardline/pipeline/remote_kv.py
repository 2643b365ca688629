"""A key's KV out of a chain (export), into it (import), or copied into another key on every stage
(copy: prefix reuse): stage 0's part here, each worker's over its own link (node/kv.py is the
other end), as RemotePipeline's stage-0 thread takes the move in submission order.

An export copies stage 0's state, sends every worker a KvPull and gathers their KvParts by seq
until each has said KvDone; the parts, per stage, make the KvSnapshot a LocalPipeline's export
makes. An import (checked before it is queued: `layout`) writes stage 0's part, then sends each
worker a KvPush and its parts; a copy makes stage 0's and sends each worker a KvCopy; once every
worker has answered, a failed import or copy is undone (stage 0 closes the key, and every
worker that opened it gets a Release) before its Future fails, naming the worker and why. A chain
that breaks ends every move under way with the reason.

Chain: the answers come on the links' readers. Star: there are none, and the stage-0 thread
reads each worker's answers itself (no step is in flight then: star runs one step at a time).
In a daisy chain a step after a move reaches a later worker through the earlier ones, not on
the link that carried the move: `settle` holds such a step back until the move has landed.

A paged export's stream moves by its blocks (protocol 14): stage 0's are read out of (or
written into) its pool here, each worker's with a KvPull / KvPush naming them, the snapshot one
row of the stream's tokens as in one process. Nothing is opened, so a failed import has nothing
to undo: its blocks hold nothing anyone reads, and the importer's scheduler frees them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shardline.errors import ShardlineError
from shardline.model.manifest import Manifest
from shardline.pipeline.held import Held
from shardline.pipeline.kv import KvSnapshot, StageKv, StageLayout, check, export_identity, frozen, snapshot
from shardline.pipeline.local import write_kv
from shardline.pipeline.plan import KvCopy, KvExport, KvImport
from shardline.stage.paged_runner import PagedRunner
from shardline.stage.runners import Stage, copy_kv
from shardline.wire.codec import WireError
from shardline.wire.link import Link, LinkClosed
from shardline.wire.messages import MAX_KV_PARTS, KvDone, KvPart, KvPull, KvPush, Refuse
from shardline.wire.messages import KvCopy as KvCopyMsg
from shardline.wire.messages import Release as ReleaseMsg

WireMove = KvExport | KvImport | KvCopy
KV_S = 60.0  # a worker that has not finished its part of a move by then is taken as hung


class KvHeld(Held):
    """Held, plus what an import put on the chain (no step of its stream was sent): a key's
    state, or a paged stream's blocks."""

    def imported(self, work: KvImport | KvCopy) -> None:
        if isinstance(work, KvImport) and work.blocks:
            self._blocks.update(work.blocks)
        else:
            self._keys.add(work.lease)


@dataclass(eq=False)
class _Move:
    work: WireMove
    seq: int
    sends: list[list[KvPull | KvPush | KvPart | KvCopyMsg]]  # per worker, in chain order
    head: StageKv | None  # an export's part of stage 0
    links: list[Link] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    parts: list[list[KvPart]] = field(default_factory=list)  # per link, as they came
    done: list[KvDone | None] = field(default_factory=list)
    deadline: float = 0.0  # monotonic
    landed: threading.Event = field(default_factory=threading.Event)

    @property
    def verb(self) -> str:
        return _verb(self.work)

    def keys(self) -> set[int]:
        """The keys a step must not overtake it on: the one it opens, and a copy's source (a
        paged move's: its blocks)."""
        if isinstance(self.work, KvCopy):
            return {self.work.lease, self.work.src}
        return set(self.work.blocks) if self.work.blocks else {self.work.lease}


class KvMoves:
    """The moves under way, by seq: started on the stage-0 thread, answered on the links' readers
    (chain) or on the stage-0 thread itself (star), ended by their last answer or by a break."""

    def __init__(self, manifest: Manifest, stage0: Stage | None, limit_s: float = KV_S, copy_s: float = KV_S,
                 paged0: PagedRunner | None = None) -> None:
        """`stage0`: None on a paged export, whose stage 0 is `paged0` (a stream's KV moves by its
        blocks). `limit_s`: how long a worker may take over its part of an export or import (it
        moves a whole cache over the link); `copy_s`: of a copy (on the worker alone: a step's)."""
        self.manifest, self._stage0, self.limit_s, self.copy_s = manifest, stage0, limit_s, copy_s
        self.paged0 = paged0
        self.identity = export_identity(manifest)
        self._layout: list[StageLayout] | None = None
        self._lock = threading.Lock()
        self._moves: dict[int, _Move] = {}

    @property
    def stage0(self) -> Stage:
        if self._stage0 is None:
            raise ShardlineError("a paged pipeline moves no KV by lease (its blocks are the scheduler's)")
        return self._stage0

    def busy(self) -> bool:
        """Whether any move is under way (a paged step then settles on its blocks)."""
        return bool(self._moves)

    def layout(self) -> list[StageLayout]:
        """What an import must fit: stage 0 as its compiled model reports it; the workers' stages
        from the manifest (their variables, the model's kv_heads and head_dim, stage 0's dtype).
        Each worker checks its own parts again against its compiled stages."""
        if self._layout is None:
            mine = self.paged0.kv_layout() if self.paged0 is not None else self.stage0.kv_layout()
            dtype = next(iter(mine.values()))[0]
            arch, (e0, *rest) = self.manifest.arch, self.manifest.stages
            spec = (dtype, arch.n_kv_heads, arch.head_dim)
            self._layout = [StageLayout(e0.first_layer, e0.last_layer, mine)] + [
                StageLayout(e.first_layer, e.last_layer, dict.fromkeys(e.state, spec)) for e in rest]
        return self._layout

    # --- the stage-0 thread -----------------------------------------------------------------------

    def begin(self, work: WireMove, seq: int, workers: int) -> _Move:
        """The messages for each of `workers`, and stage 0's part: an export's copy, an import's
        write. ShardlineError, with stage 0 as it was, when either cannot be done."""
        if isinstance(work, KvExport):
            sends: list[list[KvPull | KvPush | KvPart | KvCopyMsg]] = [[_pull_msg(work, seq)] for _ in range(workers)]
        elif isinstance(work, KvCopy):
            sends = [[_copy_msg(work, seq)] for _ in range(workers)]
        else:
            sends = [list(_pushes(work, seq, i, workers)) for i in range(workers)]
        try:
            if isinstance(work, KvExport | KvImport) and work.blocks:
                return self._begin_paged(work, seq, sends)
            if isinstance(work, KvExport):
                e = self.stage0.entry
                head = StageKv(e.first_layer, e.last_layer, frozen(self.stage0.kv(work.lease, work.start)))
                return _Move(work, seq, sends, head)
            if isinstance(work, KvCopy):
                copy_kv(self.stage0, work.src, work.dst, work.row, work.index)
            else:
                write_kv(self.stage0, work.lease, work.snap.stages[0])
            return _Move(work, seq, sends, None)
        except Exception as e:  # noqa: BLE001 - the move fails with the reason; the thread goes on
            raise ShardlineError(f"stage 0: {_why(e)}") from None

    def _begin_paged(self, work: KvExport | KvImport, seq: int,
                     sends: list[list[KvPull | KvPush | KvPart | KvCopyMsg]]) -> _Move:
        """Stage 0's part of a paged move: its blocks read out, or the snapshot written in."""
        if self.paged0 is None:
            raise ShardlineError("KV blocks move on a paged pipeline only")
        if isinstance(work, KvImport):
            self.paged0.write(work.blocks, dict(work.snap.stages[0].arrays))
            return _Move(work, seq, sends, None)
        e = self.manifest.stages[0]
        return _Move(work, seq, sends, StageKv(e.first_layer, e.last_layer,
                                               frozen(self.paged0.read(work.blocks, work.tokens))))

    def track(self, move: _Move, links: list[Link], workers: list[str]) -> None:
        """From now on its answers count, and a break ends it (called under the pipeline's lock,
        with the chain known whole, before anything is sent: answers may come back at once)."""
        move.links, move.workers = links, workers
        move.parts, move.done = [[] for _ in links], [None] * len(links)
        move.deadline = time.monotonic() + self._limit(move)
        with self._lock:
            self._moves[move.seq] = move

    def run(self, move: _Move, star: bool) -> None:
        """Send each worker its part of the move. Star: there is no reader, so each worker's
        answers are read here, worker after worker. LinkClosed, Refused, WireError or
        ShardlineError: a link is no longer usable (the caller breaks the chain)."""
        for link, sends in zip(move.links, move.sends, strict=True):
            for msg in sends:
                link.send(msg)
            if star:
                self._read(move, link)

    def _read(self, move: _Move, link: Link) -> None:
        while not move.landed.is_set():
            msg = link.recv()
            if isinstance(msg, Refuse):
                raise ShardlineError(f"worker {link.name} refused: {msg.reason}")
            if not isinstance(msg, KvPart | KvDone) or msg.seq != move.seq:
                raise ShardlineError(f"unexpected {type(msg).__name__} from worker {link.name}")
            self.received(link, msg)
            if isinstance(msg, KvDone):
                return

    def settle(self, keys: set[int]) -> None:
        """Wait until no move of these keys is under way: a step sent before its move landed
        could reach a later worker of a daisy chain before it (bounded: a move that overruns
        its deadline is ended by the watchdog, with the chain)."""
        with self._lock:
            moves = [m for m in self._moves.values() if m.keys() & keys]
        for move in moves:
            move.landed.wait(max(0.0, move.deadline - time.monotonic()) + 5.0)

    def refused(self, work: WireMove, why: str) -> None:
        """The move did not start (stage 0 left as it was)."""
        work.done.set_exception(ShardlineError(f"cannot {_verb(work)} the KV of key {work.lease}: {why}"))

    # --- answers and breaks -----------------------------------------------------------------------

    def received(self, link: Link, msg: KvPart | KvDone) -> _Move | None:
        """An answer on `link` (a reader's, or the stage-0 thread's in star); the move it ended."""
        with self._lock:
            move = self._moves.get(msg.seq)
            i = next((i for i, lk in enumerate(move.links) if lk is link), None) if move else None
            if move is None or i is None or move.done[i] is not None:
                return None  # a move a break ended, or not this link's: nothing waits for it
            if isinstance(msg, KvPart):
                if len(move.parts[i]) < MAX_KV_PARTS:
                    move.parts[i].append(msg)
                return None
            move.done[i] = msg
            if any(d is None for d in move.done):
                return None
            del self._moves[move.seq]
        self.end(move, self._failure(move))
        return move

    def overdue(self) -> str | None:
        """What a move past its deadline waits for (None: none is)."""
        now = time.monotonic()
        with self._lock:
            move = next((m for m in self._moves.values() if now > m.deadline), None)
        if move is None:
            return None
        return f"did not answer the {move.verb} of the KV of key {move.work.lease} within {self._limit(move):g} s"

    def _limit(self, move: _Move) -> float:
        return self.copy_s if isinstance(move.work, KvCopy) else self.limit_s

    def stopped(self, inbox: queue.Queue[Any]) -> None:
        """The pipeline stopped: the moves under way, and those still queued, fail."""
        self.fail_all("the pipeline stopped")
        while not inbox.empty():
            if isinstance(work := inbox.get_nowait(), KvExport | KvImport | KvCopy):
                self.refused(work, "the pipeline stopped")

    def fail_all(self, reason: str) -> None:
        """The chain broke: every move under way ends with `reason`."""
        with self._lock:
            moves, self._moves = list(self._moves.values()), {}
        for move in moves:
            self.end(move, reason)

    def end(self, move: _Move, error: str) -> None:
        """Resolve the move's Future; a failed import is undone first (nothing stays half open)."""
        work = move.work
        try:
            if error:
                if isinstance(work, KvImport | KvCopy):
                    self._undo(move)
                raise ShardlineError(error)
            if isinstance(work, KvExport):
                work.done.set_result(self._snapshot(move))
            else:
                work.done.set_result(None)
        except Exception as e:  # noqa: BLE001 - whatever went wrong is the Future's, not the reader's
            if not work.done.done():
                work.done.set_exception(ShardlineError(f"cannot {move.verb} the KV of key {work.lease}: {_why(e)}"))
        finally:
            move.landed.set()

    def _failure(self, move: _Move) -> str:
        """Why the move failed, worker by worker ("" when every worker did its part). A pull's
        KvDone counts the parts sent (none may be lost on the way), a push's those taken."""
        why = []
        pull = isinstance(move.work, KvExport)
        for name, done, parts in zip(move.workers, move.done, move.parts, strict=True):
            if done is not None and done.error:
                why.append(f"worker {name}: {done.error}")
            elif done is not None and pull and done.parts != len(parts):
                why.append(f"worker {name}: {len(parts)} parts for {done.parts} announced")
        return "; ".join(why)

    def _snapshot(self, move: _Move) -> KvSnapshot:
        """Stage 0's part and the workers' parts, per stage (they come stage by stage), checked
        against this export as an import would check it."""
        assert move.head is not None
        stages: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        for part in (p for parts in move.parts for p in parts):
            stages.setdefault((part.first_layer, part.last_layer), {})[part.name] = part.state
        assert isinstance(move.work, KvExport)
        start = move.work.start
        snap = snapshot(self.identity, [move.head, *(StageKv(f, la, frozen(a)) for (f, la), a in stages.items())],
                        start)
        check(replace(snap, start=0), self.identity, self.layout())  # a slice fits as a whole cache would
        return snap

    def _undo(self, move: _Move) -> None:
        """Close the key on stage 0 and on every worker that opened it (a worker that refused it
        opened nothing: a key it held before is not touched). A paged import's blocks hold
        nothing anyone reads: its scheduler frees them with the failed move."""
        if isinstance(move.work, KvImport) and move.work.blocks:
            return
        self.stage0.close(move.work.lease)
        for link, done in zip(move.links, move.done, strict=True):
            if done is not None and not done.error:
                with contextlib.suppress(LinkClosed, WireError):  # a worker gone holds nothing of it
                    link.send(ReleaseMsg(move.work.lease))


def _pushes(work: KvImport, seq: int, i: int, workers: int) -> list[KvPull | KvPush | KvPart]:
    """Worker i's KvPush and parts. One stage per worker is the usual chain; otherwise which
    worker runs which stages is not known here, and each worker gets them all and keeps its own
    (node/kv.py). ShardlineError for a snapshot the wire cannot carry."""
    snap, later = work.snap, work.snap.stages[1:]
    share = [later[i]] if len(later) == workers else later
    try:
        parts = [KvPart(seq, s.first_layer, s.last_layer, name, s.arrays[name])
                 for s in share for name in sorted(s.arrays)]
        blocks = np.asarray(work.blocks, np.int32) if work.blocks else None
        return [KvPush(seq, work.lease, snap.rows, snap.slots, len(parts), blocks), *parts]
    except ValueError as e:  # what messages.py checks of every message, ours too
        raise ShardlineError(f"a KV snapshot of {snap.rows} rows of {snap.slots} slots cannot travel: {e}") from None


def _pull_msg(work: KvExport, seq: int) -> KvPull:
    if not work.blocks:
        return KvPull(seq, work.lease, work.start)
    try:
        return KvPull(seq, work.lease, 0, np.asarray(work.blocks, np.int32), work.tokens)
    except ValueError as e:  # what messages.py checks of every message, ours too
        raise ShardlineError(f"a pull of {len(work.blocks)} blocks cannot travel: {e}") from None


def _copy_msg(work: KvCopy, seq: int) -> KvCopyMsg:
    try:
        return KvCopyMsg(seq, work.src, work.dst, work.row, np.asarray(work.index, np.int64))
    except ValueError as e:  # what messages.py checks of every message, ours too
        raise ShardlineError(f"a copy of {work.index.size} slots cannot travel: {e}") from None


def _verb(work: WireMove) -> str:
    return "export" if isinstance(work, KvExport) else "copy" if isinstance(work, KvCopy) else "import"


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
