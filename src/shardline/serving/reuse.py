"""Prefix reuse in the scheduler's terms: a new stream starts from a kept prefix's copy, an
ended stream's KV is kept, as KvCopy items of the next plan (pure: the KV table records them).

- `start`: a stream about to prefill (its first chunk next; looked up then, not when it arrived,
  so that what was kept meanwhile counts) whose prompt starts with an entry of its scope gets the
  entry's first n slots copied into its own lease (not opened yet), its book a cache of those n
  positions; once that copy is in (`Stream.copying` done) it prefills only the rest (its first
  chunk then opens nothing). If the copy failed, it prefills everything: a miss, never a wrong
  answer; the entry is forgotten (a worker that restarted holds nothing of it).
- `unblocked`: of the streams waiting to prefill, those that need not wait. A stream whose
  prompt shares most of itself with an earlier stream's prompt still prefilling (requests that
  arrived together with one system prompt) waits for that prompt to be kept, then starts from
  it: one prefill of the shared part instead of one per request.
- `keep_prompt`: a stream whose prompt is in has the prompt's slots copied into an entry, so
  that prompts arriving while it still runs (a shared system prompt) start from it.
- `keep`: a stream that ended well has its attended slots (its tokens' KV, in order, without
  rejected drafts or pads) copied from its state (its own lease, or its row of a decode group's)
  into a fresh lease: the entry. It may be matched at once: a pipeline takes its items in order,
  so a copy from it comes after its own; if its own failed, so does the copy from it.
- `landed`: copies done since the last round: a stream's lets it prefill (and unpins its
  entry); an entry whose own copy failed is forgotten.
The copies run before the round's releases and steps (Plan), so an entry freed in the same
round is copied from first.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from shardline.pipeline.plan import KvMove, Lease
from shardline.serving.kv_table import KvTable
from shardline.serving.prefix import Entry, PrefixCache, common_prefix
from shardline.serving.stream import Stream
from shardline.stage.cache import KVBook


@dataclass
class Reuse:
    cache: PrefixCache
    kv: KvTable
    # (entry, its copy, the stream copied into; None: the entry's own copy)
    _copying: list[tuple[Entry, Future[None], Stream | None]] = field(default_factory=list)

    def start(self, s: Stream) -> None:
        """`s`'s first chunk is next: it starts from the longest kept prefix of its scope, if any
        (looked for once)."""
        if s.prefix_looked or s.prefix_scope is None or s.prefilled or s.resumed:
            return
        s.prefix_looked = True
        hit = self.cache.match(s.prompt, s.prefix_scope)
        if hit is None:
            return
        entry, n = hit
        _, s.copying = self.kv.copy(entry.lease, np.arange(n), to=s.key)
        s.book, s.prefilled = self.kv.book(s.key), n
        self._copying.append((entry, s.copying, s))

    def unblocked(self, prefilling: list[Stream], paced: Callable[[Stream], bool] = lambda _: False) -> list[Stream]:
        """`prefilling` (in admission order) less the streams that wait for an earlier one's
        prompt. The first of streams sharing a prompt never waits: each wait ends. A short
        prompt (not `paced`) never waits for a paced one, whose last chunks the pacing may hold
        back for many rounds: it would save a few hundred tokens at most (issue 35)."""
        return [s for i, s in enumerate(prefilling)
                if not any(self._waits(s, e) and (paced(s) or not paced(e)) for e in prefilling[:i])]

    def _waits(self, s: Stream, e: Stream) -> bool:
        """Whether `s`, not started, waits for the earlier `e`'s prompt to be kept: they share
        at least half of `s`'s prompt beyond what is kept already, and what `e` has left to
        prefill is at most twice that (waiting costs `e`'s rest; it saves the shared part)."""
        if (s.prefix_looked or s.prefilled or s.resumed or e.resumed or s.prefix_scope is None
                or e.prefix_scope != s.prefix_scope or not self.cache.fits(len(e.prompt))):
            return False
        mine = np.asarray(s.prompt, np.int64)
        shared = min(common_prefix(np.asarray(e.prompt, np.int64), mine), len(mine) - 1)
        gain = shared - self.cache.covers(s.prompt, s.prefix_scope)
        return gain >= max(self.cache.min_tokens, len(mine) // 2) and len(e.prompt) - e.prefilled <= 2 * gain

    def keep(self, s: Stream, src: Lease, row: int) -> None:
        """`s` ended (nothing in flight), its KV in row `row` of `src`'s state: its tokens' KV is
        kept (prompt and answer: a chat's next turn starts with them)."""
        if s.prefix_scope is None or s.prefilling:
            return
        seq = s.prompt + s.generated
        self._copy(s.prefix_scope, seq, s.book.attended()[: len(seq)], src, row)

    def keep_prompt(self, s: Stream) -> None:
        """`s` has its prompt in (its first token chosen, its state still its own lease): the
        prompt's KV is kept now, so that requests arriving while it runs share it (a system
        prompt), unless a kept entry already holds nearly all of it."""
        s.prompt_kept = True
        n = len(s.prompt)
        if s.prefix_scope is None or s.resumed:
            return
        if self.cache.covers(s.prompt, s.prefix_scope) >= n - self.cache.min_tokens:
            return
        self._copy(s.prefix_scope, s.prompt, s.book.attended()[:n], s.key, 0)

    def _copy(self, scope: str, tokens: list[int], slots: np.ndarray, src: Lease, row: int) -> None:
        tokens = tokens[: len(slots)]
        if not self.cache.fits(len(tokens)):
            return
        lease, done = self.kv.copy(src, slots, row)
        entry, drop = self.cache.keep(lease, tokens, scope)
        for gone in drop:
            self.kv.free(gone)
        if entry is not None:
            self._copying.append((entry, done, None))

    def moved(self, item: KvMove) -> None:
        """A KV move landed: if it is one of these copies, it is taken in now."""
        mine = next((c for c in self._copying if c[1] is item.done), None)
        if mine is None:
            return
        self._copying.remove(mine)
        entry, done, into = mine
        if into is not None:
            self.cache.unpin(entry)
            self._arrived(into, done)
            if done.exception() is not None:  # its source is not whole (a worker restarted): gone
                self._forget(entry)
        elif done.exception() is not None:  # nothing of it is held: its lease was closed everywhere
            self._forget(entry)

    def settled(self) -> bool:
        """No copy is under way (any thread: for tests and tools that wait for one)."""
        return all(done.done() for _, done, _ in list(self._copying))

    def _forget(self, entry: Entry) -> None:
        if entry in self.cache.entries:
            self.cache.forget(entry)
            self.kv.free(entry.lease)

    def _arrived(self, s: Stream, done: Future[None]) -> None:
        """`s`'s copy is in: it prefills the rest; or it failed (its lease closed everywhere):
        it prefills everything, from an empty cache."""
        s.copying = None
        if done.exception() is not None and s.key in self.kv.books:  # (not if it ended meanwhile)
            self.cache.stats.tokens_saved -= s.prefilled
            s.book = self.kv.books[s.key] = KVBook()
            s.prefilled = 0

    def clear(self) -> None:
        """A chain broke: what the stages hold is no longer known; every entry goes (a stream
        being copied into is replayed, or lands as the copy says)."""
        for lease in self.cache.clear():
            self.kv.free(lease)
        self._copying = [c for c in self._copying if c[2] is not None]
