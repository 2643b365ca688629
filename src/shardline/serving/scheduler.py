"""The scheduler decides what runs together; pipelines execute its plans. `Scheduler` is what
the engine asks of one (the Protocol it is typed against); `KeyedScheduler` here plans a keyed
pipeline's steps (stateful or static stages), PagedScheduler (paged_scheduler.py) a paged one's.

Each call of `KeyedScheduler.plan()` looks at every running stream and returns the round's `Plan`: the keys
to release, then the steps to submit now:
- decode: each decode group whose members all have their next token launches one batched
  step (joiners merged in first); with no groups, each such stream steps on its own;
- prefill: prompts go in chunks, the oldest `max_prefills` prompts at a time, each with one
  chunk in flight. With nothing decoding a chunk is `chunk` tokens; while streams decode, its
  size and how often one runs come from `pacing` (pacing.py: a time budget per chunk from costs
  learned online, and prefill's share of the time), so running streams keep their pace while
  a long prompt arrives, whatever its context. `pacing=None` keeps fixed chunks (the old
  policy, which let a 128-token chunk at a long context stall streams for ~0.5 s).

- handoffs (a prefill instance's, given as a `Handoffs` policy): a stream with nothing in flight
  whose policy says so has the slots of its KV not exported yet exported; one that leaves is
  then removed (its lease released after the export) and handed to the engine (`take_left`).

Every stream has at most one step in flight, so a stream's steps reach each stage in order.
When a stream ends, `remove` frees its own key and, if it leaves a group empty, the group's:
the next plan (or `releases()`, when nothing more is planned) hands those keys to the pipeline.
With a prefix cache (reuse.py), a stream about to prefill starts from a kept prefix when one
matches (one sharing most of its prompt with an earlier one still prefilling waits for that
prompt to be kept), and a stream that ended well is kept first (its KV copied by the next plan
before the releases); a stream leaving for another instance has its prompt kept here.
No processes, no I/O: tested as plain objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

from shardline.config import COMPACT_AT, DEFAULT_PREFILL_CHUNK, PacingConfig
from shardline.decoding.drafts import NO_DRAFTS, Proposal, drafted
from shardline.errors import ShardlineError
from shardline.pipeline.kv import Handoff, KvSnapshot, handoff
from shardline.pipeline.plan import KvMove, Lease, Plan, Step, decode_step, prefill_step, reserve
from shardline.pipeline.timing import Timing
from shardline.serving.constrained import late_masks
from shardline.serving.groups import MAX_ROWS, Groups
from shardline.serving.kv_blocks import BlockCounts
from shardline.serving.kv_table import KvTable
from shardline.serving.pacing import Pacing
from shardline.serving.prefix import PrefixCache, PrefixStats
from shardline.serving.reuse import Reuse
from shardline.serving.stream import Stream


@dataclass(frozen=True)
class SchedulerConfig:
    chunk: int = DEFAULT_PREFILL_CHUNK
    # A short prompt's chunk (pacing.py), so that it goes in one call where the stages take it
    # (each call has a fixed cost of ~25-35 ms on 2 cores); 0: `chunk`
    short_chunk: int = 0
    groups: int = 1  # decode groups; 0: every stream decodes on its own request
    max_rows: int = MAX_ROWS  # rows per group
    max_prefills: int = 2  # prompts prefilling at once (oldest first)
    compact_at: int = COMPACT_AT  # masked slots of a stream's cache that a decode step compacts
    # Chunk sizes while streams decode (pacing.py); None: every chunk `chunk` tokens (the old policy)
    pacing: PacingConfig | None = field(default_factory=PacingConfig)

    def __post_init__(self) -> None:
        if self.short_chunk < 0:
            raise ShardlineError("a short prompt's chunk must be >= 0 tokens")
        if self.chunk < 1 or self.groups < 0 or self.max_rows < 1 or self.max_prefills < 1 or self.compact_at < 1:
            raise ShardlineError("chunk, max rows, max prefills and compact_at must be >= 1 and groups >= 0")


class Handoffs(Protocol):
    """Which streams leave this instance for another (pure, over a stream with no step in flight)."""

    def leaves(self, s: Stream) -> bool: ...  # it leaves now, the rest of its KV exported first
    def exports(self, s: Stream) -> bool: ...  # it stays, its KV written since its last export goes out now


class Scheduler(Protocol):
    """What the engine, its speculation and the disaggregation roles ask of a scheduler."""

    streams: dict[int, Stream]  # running, by id, in admission order
    handoffs: Handoffs | None  # which streams leave (set by the engine from its role)
    kv: KvTable  # the streams' leases
    groups: Groups  # decode groups (none on blocks): the speculation reads a step's rows from them

    def add(self, stream: Stream) -> None: ...
    def remove(self, stream: Stream, keep: bool = False) -> None: ...  # it ended (`keep`: well)
    def replay(self, stream: Stream, key: Lease) -> None: ...  # it starts again on `key`
    def releases(self) -> list[int]: ...
    def moved(self, item: KvMove) -> None: ...  # a KV move landed
    def plan(self, drafts: Mapping[int, Proposal] | None = None) -> Plan: ...
    def observe(self, stream: Stream, timing: Timing) -> None: ...  # what its step cost
    def handoff(self, stream: Stream, kv: KvSnapshot) -> Handoff: ...
    def room(self, tokens: int) -> bool: ...
    def arrive(self, stream: Stream, moving: Handoff) -> Future[None]: ...
    def unarrive(self, stream: Stream) -> None: ...
    def take_left(self) -> list[Stream]: ...
    def kept(self) -> tuple[PrefixStats, int]: ...  # prefix reuse so far, the bytes kept now (any thread)
    def covers(self, prompt: list[int], scope: str) -> int: ...  # prompt tokens a kept prefix saves
    def drop_kept(self) -> list[int]: ...  # every kept prefix dropped: the leases to release
    def block_counts(self) -> BlockCounts | None: ...  # a block pool's (None: no blocks)
    def held_bytes(self) -> int | None: ...  # the bytes of the blocks streams hold (None: no blocks)


class KeyedScheduler:
    def __init__(self, cfg: SchedulerConfig | None = None, handoffs: Handoffs | None = None,
                 prefix: PrefixCache | None = None) -> None:
        self.cfg = cfg or SchedulerConfig()
        self.handoffs = handoffs
        self._left: list[Stream] = []  # handed off by the last plans, for the engine (take_left)
        self.groups = Groups(self.cfg.groups, self.cfg.max_rows)
        self.pacing = Pacing(self.cfg.pacing, self.cfg.chunk) if self.cfg.pacing else None
        self.streams: dict[int, Stream] = {}  # running, by id, in admission order
        self.kv = KvTable()  # the leases of this scheduler's pipeline, and those to release
        self.reuse = Reuse(prefix, self.kv) if prefix is not None else None

    def add(self, stream: Stream) -> None:
        self.streams[stream.id] = stream

    def remove(self, stream: Stream, keep: bool = False) -> None:
        """`stream` ended (none of its steps in flight): keep its KV as a prefix if `keep` (it
        ended well) and there is a prefix cache; free its own key (if its KV never became a
        group's row, it is still there) and a group it leaves empty."""
        if stream.in_flight:
            raise ShardlineError(f"stream {stream.id} still has a step in flight")
        self.streams.pop(stream.id, None)
        if keep and self.reuse is not None:
            group = self.groups.group_of(stream.id)
            if group is not None and stream.id in group.held:
                self.reuse.keep(stream, Lease(group.key), group.held.index(stream.id))
            else:
                self.reuse.keep(stream, stream.key, 0)
        self.kv.free(stream.key)
        if (emptied := self.groups.leave(stream.id)) is not None:
            self.kv.free(Lease(emptied))

    def replay(self, stream: Stream, key: Lease) -> None:
        """`stream`'s KV went with a broken pipeline: free its lease, and its group's if it
        leaves the group empty; it starts again on the lease `key` (Stream.restart), keeping its
        id and its place among the streams (the oldest prompts prefill first)."""
        old = stream.key
        if self.reuse is not None:
            self.reuse.clear()
        stream.restart(key, self.kv.books.get(key))
        self.kv.free(old)
        if (emptied := self.groups.leave(stream.id)) is not None:
            self.kv.free(Lease(emptied))

    def releases(self) -> list[int]:
        return list(self.kv.take_freed())

    def moved(self, item: KvMove) -> None:
        """A KV move landed: a prefix copy is taken in (reuse.py); the rest are the role's."""
        if self.reuse is not None:
            self.reuse.moved(item)

    def kept(self) -> tuple[PrefixStats, int]:
        reuse = self.reuse
        return (replace(reuse.cache.stats), reuse.cache.held) if reuse is not None else (PrefixStats(), 0)

    def covers(self, prompt: list[int], scope: str) -> int:
        """A reading that may be stale by the time the request starts (a front routes by it)."""
        if self.reuse is None:
            return 0
        n = self.reuse.cache.covers(prompt[:-1], scope)  # as `match` counts: the last token runs
        return n if n >= self.reuse.cache.min_tokens else 0

    def drop_kept(self) -> list[int]:
        if self.reuse is not None:
            self.reuse.clear()
        return self.releases()

    def block_counts(self) -> BlockCounts | None:
        return None

    def held_bytes(self) -> int | None:
        return None

    def plan(self, drafts: Mapping[int, Proposal] | None = None) -> Plan:
        """This round's plan; `drafts`: the drafts each stream about to decode offers, by stream
        (the engine's speculation chose them; the scheduler only places them in the rows)."""
        self._hand_off()
        if self.reuse is not None:
            for s in self.streams.values():  # prompts just in, before they join a decode group
                if s.decoding and not s.prompt_kept and not s.in_flight and not self.groups.has(s.id):
                    self.reuse.keep_prompt(s)
        releases = tuple(self.releases())  # after the exports, before the steps: see Plan
        steps = self._decodes(drafts or {}) + self._prefills()
        for step in steps:  # each stream is in one step at most: its book is reserved once
            rows = [self.streams[s] for s in step.streams]
            reserve(step, [s.book for s in rows])
            for s in rows:
                s.in_flight = True
        exports, imports = self.kv.take_moves()
        return Plan(releases, tuple(steps), exports, imports, self.kv.take_copies())

    def handoff(self, stream: Stream, kv: KvSnapshot) -> Handoff:
        """`stream` as it moves: its KV and a copy of its book (masked slots and all)."""
        return handoff(kv, stream.book)

    def room(self, tokens: int) -> bool:
        """A stream arriving always finds room here (its instance's admission policy decides)."""
        return True

    def arrive(self, stream: Stream, moving: Handoff) -> Future[None]:
        """A prefilled stream arrives: its KV imported on a fresh lease by the next plan (a
        KvImport); it joins (`add`) once that is in."""
        stream.key, done = self.kv.import_(moving.kv, moving.book())
        stream.book = self.kv.book(stream.key)
        return done

    def unarrive(self, stream: Stream) -> None:
        """An arrival that will not join: its lease goes."""
        self.kv.free(stream.key)

    def take_left(self) -> list[Stream]:
        """The streams handed off since the last call, each with its KV's exports (handover.kv_sent)."""
        out, self._left = self._left, []
        return out

    def _hand_off(self) -> None:
        if self.handoffs is None:
            return
        for s in [s for s in self.streams.values() if not s.in_flight]:
            leaves = self.handoffs.leaves(s)
            if leaves or (self.handoffs.exports(s) and s.book.slots > s.handover.kv_through):
                # the slots the stages hold (nothing in flight): those the book has committed
                s.handover.kv_sent.append(self.kv.export(s.key, s.handover.kv_through))
                s.handover.kv_through = s.book.slots
            if leaves:
                if self.reuse is not None:  # its prompt's KV stays here, kept, as its copy leaves
                    self.reuse.keep_prompt(s)
                self.remove(s)
                self._left.append(s)

    def _decodes(self, drafts: Mapping[int, Proposal]) -> list[Step]:
        idle = [s for s in self.streams.values() if s.idle_decoder()]
        if not self.cfg.groups:
            return [self._alone(s, drafts.get(s.id, NO_DRAFTS)) for s in idle]
        for s in idle:
            if not self.groups.has(s.id):
                self.groups.join(s.id)
        return [g.launch(self.streams, drafts, self.cfg.compact_at) for g in self.groups if g.ready(self.streams)]

    def _alone(self, s: Stream, proposal: Proposal) -> Step:
        """A decode step of `s` on its own request: its token and drafts, each position sampled."""
        return decode_step(s.id, s.book, s.feed(proposal.tokens), s.params, sample_all=True,
                           want_logits=s.want_logits, compact=s.book.masked >= self.cfg.compact_at,
                           drafted=drafted([proposal]), key=s.key, masks=late_masks([s.constraint], [proposal.tokens]))

    def _prefills(self) -> list[Step]:
        """The next chunk of each prompt that may go now. Short prompts (pacing.py) and long ones
        each take up to `max_prefills` places, oldest first: a long prompt never holds a short
        one back, and a burst of short ones adds a bounded gap to the running streams."""
        waiting = [s for s in self.streams.values() if s.prefilling]
        if self.reuse is not None:
            waiting = self.reuse.unblocked(waiting, self._paced)
        short: list[Stream] = []
        long: list[Stream] = []
        for s in waiting:
            (long if self._paced(s) else short).append(s)
        short, long = short[: self.cfg.max_prefills], long[: self.cfg.max_prefills]
        if self.reuse is not None:
            for s in short + long:  # their first chunks are next: from a kept prefix, if one matches
                self.reuse.start(s)
        ready = [s for s in long if not s.in_flight and s.copying is None]
        if self.pacing is None:
            sizes = [self.cfg.chunk] * len(ready)
        else:
            decoding = any(not s.prefilling for s in self.streams.values())
            sizes = self.pacing.sizes([(len(s.prefix()) - s.prefilled, s.prefilled) for s in ready], decoding,
                                      prefilling=bool(long))
        whole = max(self.cfg.chunk, self.cfg.short_chunk)
        steps = [self._chunk(s, whole) for s in short if not s.in_flight and s.copying is None]
        return steps + [self._chunk(s, n) for s, n in zip(ready, sizes, strict=True) if n]

    def _paced(self, s: Stream) -> bool:
        """Whether `s`'s prompt is paced: not a short one, as it stood when its first chunk went
        (after a kept prefix it starts from), so a long prompt's last chunks stay paced."""
        if s.paced is not None:
            return s.paced
        return self.pacing is not None and not self.pacing.short(len(s.prefix()) - s.prefilled)

    def _chunk(self, s: Stream, n: int) -> Step:
        s.paced = self._paced(s)
        start, source = s.prefilled, s.prefix()
        s.prefilled = min(len(source), start + n)
        s.chunk = (s.prefilled - start, start)
        last = not s.prefilling
        return prefill_step(s.id, s.book, source[start : s.prefilled], s.params, first=start == 0, last=last,
                            want_logits=s.want_logits, key=s.key,
                            masks=late_masks([s.constraint], [[]]) if last else None)

    def observe(self, stream: Stream, timing: Timing) -> None:
        """What one step of `stream` cost (its graph seconds over every stage), for the pacing."""
        if self.pacing is None:
            return
        seconds = sum(timing.graph_s.values())
        if timing.phase == "prefill" and stream.chunk is not None:
            # a prompt's first chunk also opens the stream's request on every stage (measured
            # 2-5x a later chunk's time), which no later chunk pays: counted, not learnt from
            n, cached = stream.chunk
            self.pacing.chunk_done(n, cached, seconds, learn=cached > 0, counted=stream.paced is not False)
        elif timing.phase == "decode":
            self.pacing.decode_step(seconds)
