"""The scheduler of a paged pipeline (issue 41), pure: each round, one ragged step of every idle
stream's decode token and the prompt chunks that fit the token budget (serving/ragged.py), each
over its block table (serving/kv_blocks.py), fused into one call of every stage.

- Decode tokens go first and whole: a running stream never waits for a prompt. Prompt chunks
  fill the budget left, oldest first. While streams decode, a long prompt's chunk is sized by
  the same learned pacing as the stateful scheduler's (pacing.py: a time budget per step, and
  prefill's share), learnt from fused steps by taking the decode part out of their time.
- Blocks are taken as tokens are planned: admission counts what a stream holds and needs now,
  never its worst case. They go oldest stream first: a stream short of them preempts the
  youngest idle streams younger than itself (their blocks freed, their tokens prefilled again
  later), as vLLM's recompute does, never an older one; a prompt waits while the blocks left
  do not cover both what the older prompts still need and its own rest. So the oldest stream
  always progresses, and prompts in flight never split the pool so that none can finish
  (issue 54: two long prompts on a pool of fewer than two contexts stalled for good).
- Speculation: a stream's drafts ride after its token, every position sampled; the drafts that
  did not stand are dropped by a shorter past and their blocks go back (no masked slots, no
  compaction): the next round plans from what the stream holds.
- Prefix reuse is by shared blocks: a prompt's first chunk starts from the longest run of
  cached full blocks that hash like its own prefix (in its scope), referenced, not copied. A
  block is hashed only once the step that wrote it came back (the stream is idle again), so no
  stream ever reads a block still being written.

- Disaggregated serving: a stream that leaves (the `Handoffs` policy) has its blocks read out
  (a KvExport of its blocks, before any later step may reuse them) and goes; one that arrives
  takes blocks for its tokens here and has the snapshot written into them (a KvImport) before
  it joins.

No groups, no merges, no compaction, nothing to release on the stages: a stream's state is its
block table. No processes, no I/O: tested as plain objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace

from shardline.decoding.drafts import NO_DRAFTS, Proposal, drafted
from shardline.errors import ShardlineError
from shardline.pipeline.kv import Handoff, KvSnapshot
from shardline.pipeline.plan import KvExport, KvImport, KvMove, Lease, Plan
from shardline.pipeline.ragged_step import Part, RaggedStep
from shardline.pipeline.timing import Timing
from shardline.serving.constrained import late_masks
from shardline.serving.groups import Groups
from shardline.serving.kv_blocks import BlockCounts, BlockPool, BlockTable, blocks_for
from shardline.serving.kv_table import KvTable
from shardline.serving.pacing import Pacing
from shardline.serving.prefix import PrefixStats
from shardline.serving.ragged import Budget, Want, pack
from shardline.serving.scheduler import Handoffs, SchedulerConfig
from shardline.serving.stream import Stream
from shardline.stage.cache import KVBook


@dataclass(frozen=True)
class _Sent:
    """What a stream's step in flight carried, for learning costs when it comes back."""

    decode_tokens: int
    chunks: tuple[tuple[int, int, bool], ...]  # each prompt chunk: (tokens, cached before it, paced)


class PagedScheduler:
    def __init__(self, cfg: SchedulerConfig | None, pool: BlockPool, prefix: bool = False, in_flight: int = 1,
                 block_bytes: int = 0) -> None:
        """`block_bytes`: what a block costs over every stage (for the bytes kept, reported).
        `in_flight`: ragged steps out at once. One where every stage shares this machine's
        cores: then every stream's tokens wait for the step out and ride in the next, fused (a
        second step would run a prompt's chunk alone beside the decode step, as two calls)."""
        if in_flight < 1:
            raise ShardlineError(f"a paged scheduler keeps at least 1 step in flight, not {in_flight}")
        self.in_flight, self.block_bytes = in_flight, block_bytes
        self.cfg = cfg or SchedulerConfig()
        self.pool = pool
        self.prefix = prefix  # reuse by shared blocks
        self.pacing = Pacing(self.cfg.pacing, self.cfg.chunk) if self.cfg.pacing else None
        self.budget = Budget(max(self.cfg.chunk, self.cfg.short_chunk))  # prompt tokens a step may add
        self.streams: dict[int, Stream] = {}  # running, by id, in admission order
        self.kv = KvTable()  # leases (a stream's identity on the stages is its blocks: nothing to release)
        self.groups = Groups(0, 1)  # none on blocks: every stream's tokens ride in one ragged step
        self.preempted = 0
        self.stats = PrefixStats()  # prefix reuse by shared blocks (hits, and the prompt tokens they saved)
        self._sent: dict[int, _Sent] = {}
        self.handoffs: Handoffs | None = None  # which streams leave (set by the engine from its role)
        self._left: list[Stream] = []
        self._moves: tuple[list[KvExport], list[KvImport]] = ([], [])

    def add(self, stream: Stream) -> None:
        self.streams[stream.id] = stream

    def remove(self, stream: Stream, keep: bool = False) -> None:
        """`stream` ended (nothing in flight): its blocks go back; with `keep` (it ended well)
        its written full blocks are hashed first, so later prompts may find them."""
        if stream.in_flight:
            raise ShardlineError(f"stream {stream.id} still has a step in flight")
        self.streams.pop(stream.id, None)
        self._sent.pop(stream.id, None)
        if stream.blocks is not None:
            if keep:
                self._wrote(stream)
            self.pool.free(stream.blocks)
            stream.blocks = None
        self.kv.free(stream.key)

    def replay(self, stream: Stream, key: Lease) -> None:
        """The pipeline lost `stream`'s step (a chain broke under it): it starts again on lease
        `key` from no blocks. The blocks the chain held are gone with it, so no prefix is found
        in them any more (a replay that hit one would be lost again). A hit of `stream`'s saved
        nothing after all (its blocks were lost: it prefills them again): counted as a miss."""
        self.pool.forget()
        if stream.prefix_saved:
            self.stats.hits, self.stats.misses = self.stats.hits - 1, self.stats.misses + 1
            self.stats.tokens_saved -= stream.prefix_saved
            stream.prefix_saved = 0
        self._restart(stream, key)

    def _restart(self, stream: Stream, key: Lease) -> None:
        """`stream` starts again on lease `key` from no blocks (its old ones freed)."""
        if stream.blocks is not None:
            self.pool.free(stream.blocks)
            stream.blocks = None
        old = stream.key
        stream.restart(key, self.kv.books.get(key))
        self.kv.free(old)

    def prefix_stats(self) -> PrefixStats:
        """Prefix reuse so far: hits, misses, tokens saved, and the cached blocks evicted for new
        KV (a kept prefix lost to make room)."""
        return replace(self.stats, evicted=self.pool.evicted)

    def releases(self) -> list[int]:
        return list(self.kv.take_freed())

    def kept(self) -> tuple[PrefixStats, int]:
        """Shared blocks: the cached ones are what is kept."""
        return self.prefix_stats(), self.pool.cached * self.block_bytes

    def covers(self, prompt: list[int], scope: str) -> int:
        """The prompt tokens cached full blocks hold now (a reading: nothing is taken)."""
        return self.pool.covers(prompt, scope) if self.prefix else 0

    def drop_kept(self) -> list[int]:
        """Nothing to release: a cached block lives in the pool, which the next scheduler over
        this pipeline starts afresh."""
        return self.releases()

    def block_counts(self) -> BlockCounts | None:
        return self.pool.counts()

    def held_bytes(self) -> int | None:
        return self.pool.held * self.block_bytes

    def moved(self, item: KvMove) -> None:
        """Nothing: a moved stream's blocks are the role's to wait for (exports as it leaves,
        imports as it arrives); no prefix is copied (shared blocks)."""

    def take_left(self) -> list[Stream]:
        """The streams handed off since the last call, each with its blocks' export (kv_sent)."""
        out, self._left = self._left, []
        return out

    def handoff(self, stream: Stream, kv: KvSnapshot) -> Handoff:
        """`stream` as it moves: its tokens' KV, one attended slot per token (no masked slots)."""
        return Handoff(kv, KVBook.filled(kv.slots))

    def room(self, tokens: int) -> bool:
        """Whether a stream arriving with `tokens` tokens' KV finds blocks for them now."""
        return self.pool.fits([(BlockTable(), tokens)])

    def arrive(self, stream: Stream, moving: Handoff) -> Future[None]:
        """A prefilled stream arrives: blocks for its tokens, its KV written into them by the
        next plan (a KvImport); it joins (`add`) once that is in."""
        tokens, table = moving.kv.slots, BlockTable()
        if not self.room(tokens):
            failed: Future[None] = Future()
            failed.set_exception(ShardlineError(f"no free KV blocks for {tokens} tokens"))
            return failed
        self.pool.grow(table, tokens)
        table.written, stream.blocks, stream.key = tokens, table, self.kv.lease()
        item = KvImport(stream.key, moving.kv, blocks=tuple(table.blocks))
        self._moves[1].append(item)
        return item.done

    def unarrive(self, stream: Stream) -> None:
        """An arrival that will not join (its import failed, its caller cancelled): blocks back."""
        if stream.blocks is not None:
            self.pool.free(stream.blocks)
            stream.blocks = None
        self.kv.free(stream.key)

    def _hand_off(self) -> None:
        """Streams that leave now: the rest of their KV read out (in order: before any later step
        may take their blocks), their prompts kept for reuse here, their blocks back. A stream
        that stays but exports as it goes (chunk-level transfer) has its full blocks written
        since its last export read out now, so every slice starts at a block."""
        if self.handoffs is None:
            return
        size = self.pool.block_size
        for s in [s for s in self.streams.values() if not s.in_flight]:
            if self.handoffs.leaves(s):
                self._export(s, _fed(s))
                self.remove(s, keep=self.prefix)
                self._left.append(s)
            elif self.handoffs.exports(s) and (full := _fed(s) // size * size) > s.handover.kv_through:
                self._export(s, full)

    def _export(self, s: Stream, upto: int) -> None:
        """`s`'s KV of tokens [kv_through, upto) out of its blocks (kv_through is a block's start:
        0, or where a chunk's export of full blocks ended), as the snapshot's slots from there."""
        assert s.blocks is not None
        start, size = s.handover.kv_through, self.pool.block_size
        blocks = tuple(s.blocks.blocks[start // size : blocks_for(upto, size)])  # a table may hold one more
        item = KvExport(s.key, start=start, blocks=blocks, tokens=upto - start)
        self._moves[0].append(item)
        s.handover.kv_sent.append(item.done)
        s.handover.kv_through = upto

    def plan(self, drafts: Mapping[int, Proposal] | None = None) -> Plan:
        """This round's plan: a ragged step for each step that may still go out (`in_flight`),
        the decoding streams shared among them; `drafts`: the drafts each stream about to
        decode offers (the engine's speculation chose them), fed after its token and verified."""
        for s in self.streams.values():
            if not s.in_flight:
                self._wrote(s)
        self._hand_off()
        idle = [s for s in self.streams.values() if not s.in_flight]
        steps = []
        free = self.in_flight - len({id(self._sent.get(s.id)) for s in self.streams.values() if s.in_flight})
        while free > 0 and (parts := self._parts([s for s in idle if not s.in_flight], drafts or {}, free)):
            steps.append(self._step(parts, drafts or {}))
            free -= 1
        (exports, imports), self._moves = self._moves, ([], [])
        return Plan(tuple(self.releases()), tuple(steps), tuple(exports), tuple(imports))

    def _parts(self, idle: list[Stream], drafts: Mapping[int, Proposal], free: int) -> list[tuple[Stream, int]]:
        """(stream, new tokens) of this round's step, each with the blocks for them. With `free`
        more steps allowed out, the decoding streams are shared among them (a pipeline of
        several machines keeps one step per stage busy; each stream is in one at a time)."""
        decoding = [s for s in idle if s.idle_decoder()]
        decoding = decoding[: -(-len(decoding) // free)]
        prompts = [s for s in idle if s.prefilling][: self.cfg.max_prefills]
        for s in prompts:
            self._start(s)
        sizes = self._sizes(prompts, bool(decoding))
        wants = [Want(s.id, 1 + len(drafts.get(s.id, NO_DRAFTS).tokens), True) for s in decoding]
        wants += [Want(s.id, n, False) for s, n in zip(prompts, sizes, strict=True)]
        packed = pack(wants, Budget(sum(w.tokens for w in wants if w.decoding) + self.budget.tokens))
        return self._fit(packed)

    def _fit(self, packed: list[tuple[int, int]]) -> list[tuple[Stream, int]]:
        """The packed entries (in their order) that get the blocks for their tokens. Blocks go
        oldest stream first (admission order: a preempted or replayed stream keeps its place):
        a prompt goes only if the blocks left after what every older prompt still needs cover
        its own rest (`_rest`: prompts in flight never split the pool between them), and a
        stream short of blocks preempts idle streams younger than itself, never an older one
        (`_room`). So the oldest stream always gets what it needs once the steps in flight are
        back (every other stream is younger, and the pool holds a stream at the context:
        pipeline/paged_local.pool_blocks), and no two streams can preempt each other in turn:
        nothing stalls, nothing livelocks. A stream that waits for blocks held by younger
        streams' steps in flight holds every younger stream back this round, or they would take
        them out again with their next step."""
        order = list(self.streams.values())
        age: dict[int, int] = {v.id: i for i, v in enumerate(order)}
        granted: set[int] = set()
        for sid, n in sorted(packed, key=lambda p: age[p[0]]):
            s = self.streams[sid]
            if s.blocks is None:  # preempted by an older stream this round: it starts over next round
                continue
            older, younger = order[: age[sid]], order[age[sid] + 1 :]
            ahead = sum(self._rest(v) for v in older)
            if s.prefilling and ahead and ahead + self._rest(s) > self.pool.available:
                continue  # it waits for the older prompts (holding back no one: they go first anyway)
            if self._room(s, n, younger):
                granted.add(sid)
            elif self._victims(s, n, [v for v in reversed(younger) if _holds(v)]) is not None:
                break  # it waits for younger streams' steps in flight: they stay idle once back
        return [(self.streams[sid], n) for sid, n in packed if sid in granted]

    def _rest(self, s: Stream) -> int:
        """The blocks `s`'s prompt still lacks (0 once it decodes; all of them for one just
        preempted, whose table is gone)."""
        if not s.prefilling:
            return 0
        return max(0, blocks_for(len(s.prefix()), self.pool.block_size) - len(s.blocks.blocks if s.blocks else ()))

    def _sizes(self, prompts: list[Stream], decoding: bool) -> list[int]:
        """Each prompt's chunk: a short prompt whole (up to the budget), a long one paced while
        streams decode (pacing.py), else up to `chunk`."""
        left = [len(s.prefix()) - s.prefilled for s in prompts]
        if self.pacing is None:
            return [min(n, self.cfg.chunk) for n in left]
        for s, n in zip(prompts, left, strict=True):
            if s.paced is None:
                s.paced = not self.pacing.short(n)
        long = [(n, s.prefilled) for s, n in zip(prompts, left, strict=True) if s.paced]
        paced = iter(self.pacing.sizes(long, decoding, prefilling=bool(long)))
        return [next(paced) if s.paced else min(n, self.budget.tokens) for s, n in zip(prompts, left, strict=True)]

    def _start(self, s: Stream) -> None:
        """A prompt's first chunk is next: its table, from shared blocks if a prefix matches."""
        if s.blocks is not None:
            return
        if self.prefix and s.prefix_scope is not None:
            s.blocks = self.pool.match(s.prefix(), s.prefix_scope)
            s.prefilled = s.blocks.written
            if not s.prefix_looked:  # counted once a stream, as the keyed cache counts (a preempted one looks again)
                s.prefix_looked, s.prefix_saved = True, s.blocks.written
                self.stats.hits += s.prefix_saved > 0
                self.stats.misses += s.prefix_saved == 0
                self.stats.tokens_saved += s.prefix_saved
        else:
            s.blocks = BlockTable()

    def _room(self, s: Stream, n: int, younger: list[Stream]) -> bool:
        """Blocks for `s`'s next `n` tokens, taking the blocks of the youngest idle streams of
        `younger` while the pool is short (each starts over later, as vLLM's recompute does;
        none is preempted unless enough are to make room). False: `s` waits, nothing taken."""
        assert s.blocks is not None
        need = _fed(s) + n
        if not self.pool.fits([(s.blocks, need)]):
            idle = [v for v in reversed(younger) if not v.in_flight and _holds(v)]
            victims = self._victims(s, n, idle)
            if victims is None:
                return False
            for v in victims:
                self._restart(v, self.kv.lease())
                self.preempted += 1
        self.pool.grow(s.blocks, need)
        return True

    def _victims(self, s: Stream, n: int, candidates: list[Stream]) -> list[Stream] | None:
        """The fewest of `candidates`, in order, whose preemption frees the blocks `s`'s next
        `n` tokens lack (None: all of them would not). A block is freed only when every table
        holding it is a victim's (a prefix shared with `s` or a stream left alone stays)."""
        assert s.blocks is not None
        short = blocks_for(_fed(s) + n, self.pool.block_size) - len(s.blocks.blocks) - self.pool.available
        held: dict[int, int] = {}
        for i, v in enumerate(candidates):
            assert v.blocks is not None
            for b in v.blocks.blocks:
                held[b] = held.get(b, 0) + 1
                short -= held[b] == self.pool.ref[b]
            if short <= 0:
                return candidates[: i + 1]
        return [] if short <= 0 else None

    def _step(self, parts: list[tuple[Stream, int]], drafts: Mapping[int, Proposal]) -> RaggedStep:
        made: list[Part] = []
        offered: list[Proposal] = []  # per sampled part: its drafts (none for a prompt's last chunk)
        for s, n in parts:
            assert s.blocks is not None
            past = _fed(s)
            if s.prefilling:
                source = s.prefix()
                s.prefilled = past + n
                s.chunk = (n, past)
                tokens, prompt, proposal = source[past : past + n], True, NO_DRAFTS
            else:
                proposal = drafts.get(s.id, NO_DRAFTS)
                tokens, prompt = s.feed(proposal.tokens), False
            made.append(Part(s.id, tuple(tokens), past, tuple(s.blocks.blocks), s.params,
                             sample=not s.prefilling, prompt=prompt, every=not prompt))
            if not s.prefilling:
                offered.append(proposal)
            s.in_flight = True
        sent = _Sent(sum(len(p.tokens) for p in made if not p.prompt),
                     tuple((len(p.tokens), p.past, bool(self.streams[p.stream].paced)) for p in made if p.prompt))
        for p in made:
            self._sent[p.stream] = sent
        sampled = [self.streams[p.stream] for p in made if p.sample]
        masks = late_masks([s.constraint for s in sampled], [p.tokens for p in offered])
        return RaggedStep.of(made, any(s.want_logits for s in sampled), masks, drafted(offered))

    def _wrote(self, s: Stream) -> None:
        """`s`'s steps came back: its written full blocks hashed (when its prefixes may be reused)."""
        if s.blocks is None:
            return
        fed = _fed(s)
        self.pool.release_past(s.blocks, fed)  # a verify step's rejected drafts: their blocks back
        # hashing needs the tokens only when a block filled up (not on every decode step: the
        # sequence is as long as the context)
        if self.prefix and s.prefix_scope is not None and fed // self.pool.block_size > len(s.blocks.hashes):
            self.pool.wrote(s.blocks, (s.prompt + s.generated)[:fed], s.prefix_scope)
        else:
            s.blocks.written = fed

    def observe(self, stream: Stream, timing: Timing) -> None:
        """What a step that carried `stream` cost: its decode part teaches the step time, its
        prompt chunks (the rest) the chunk costs (pacing.py)."""
        sent = self._sent.pop(stream.id, None)
        if self.pacing is None or sent is None:
            return
        seconds = sum(timing.graph_s.values())
        if not sent.chunks:
            self.pacing.decode_step(seconds)
            return
        chunk_s = seconds - (self.pacing.step_s or 0.0 if sent.decode_tokens else 0.0)
        tokens = sum(n for n, _, _ in sent.chunks)
        for n, cached, paced in sent.chunks:  # the chunks' time shared by their tokens
            self.pacing.chunk_done(n, cached, max(chunk_s, 1e-6) * n / tokens, learn=cached > 0, counted=paced)


def _holds(s: Stream) -> bool:
    """Whether `s` holds any block (a preemption would give some back)."""
    return s.blocks is not None and bool(s.blocks.blocks)


def _fed(s: Stream) -> int:
    """Tokens of `s` whose KV its planned steps write: what is prefilled, or once decoding all
    but the last generated token (fed by its next step)."""
    return s.prefilled if s.prefilling else len(s.prompt) + len(s.generated) - 1
