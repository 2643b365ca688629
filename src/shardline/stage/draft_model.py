"""A draft model on the coordinator: a small model (its own export folder, one stage, the
target's tokenizer), or the target's first L layers (self-speculation). Each stream's drafter
holds its own KV on the shared `DraftModel`, catches up on the tokens the target accepted and
drops the drafts it rejected. While the stream's step is out on remote stages, it catches up or
draws ahead (`follow`).

The KV is the export's kind: a paged draft (issue 56) gives each drafter a block table over the
model's one pool, and a rejected draft is dropped by a shorter past (the table trimmed, its
blocks back); a stateful one gives each a request, and masks rejected drafts (KVBook).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np

from shardline.config import COMPACT_AT, RunConfig, SamplingParams
from shardline.decoding.drafts import Draw, Proposal, draw, proposal
from shardline.errors import ShardlineError
from shardline.model.context import run_context
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.stage.cache import KVBook
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.paged_runner import PagedRunner
from shardline.stage.runners import Stage, open_stage

CATCH_UP_CHUNK = 256  # tokens per draft-model call when it catches up (a prompt)
DRAFT_STREAMS = 16  # a paged draft's pool: this many streams at the full context (committed as written)


def draft_run(run: RunConfig) -> RunConfig:
    """The draft's own run config. Its tokens are proposals the target verifies (and, sampled,
    the probabilities it drew them with): its precision moves acceptance, never the output. So
    under `exact` it runs `fast` (int8 activations for compressed weights, its f16 KV), a cheaper
    draft token for the same proposals within near-ties (BENCHMARKS.md, issue 39)."""
    return replace(run, precision="fast", kv_precision=None) if run.precision == "exact" else run


class DraftModel:
    """One draft export folder, compiled once, shared by every stream's drafter."""

    def __init__(self, folder: Path, target: Manifest, run: RunConfig | None = None,
                 streams: int = DRAFT_STREAMS) -> None:
        """`streams`: a paged draft's pool holds this many streams at the full context (its
        pages committed only as blocks are written)."""
        try:
            self.manifest = load_manifest(folder)
        except ShardlineError as e:
            raise ShardlineError(f"draft model: {e}") from None
        verify(folder, self.manifest)
        if len(self.manifest.stages) != 1:
            raise ShardlineError(f"draft model {folder} has {len(self.manifest.stages)} stages; export it as one")
        if self.manifest.arch.vocab != target.arch.vocab or \
                self.manifest.files.get("tokenizer.json") != target.files.get("tokenizer.json"):
            raise ShardlineError(f"draft model {folder} does not share the target's tokenizer")
        run = draft_run(run or RunConfig())
        run = replace(run, device=run.devices[0])  # beside stage 0, on its device
        entry, vocab = self.manifest.stages[0], self.manifest.arch.vocab
        self.paged: PagedRunner | None = None
        self.runner: Stage | None = None
        if entry.runner == "paged":
            context = run_context(self.manifest.arch, run.context)
            self.paged = PagedRunner.load(folder, entry, run, 1, vocab=vocab, context=context)
            self.paged.allocate(-(-context // self.paged.block_size) * streams)
            self.free = list(range(self.paged.blocks))  # blocks no drafter holds
        else:
            self.runner = open_stage(folder, entry, run, vocab=vocab)
        self.lock = threading.Lock()  # one call at a time (the engine thread; a bench may share it)
        self._keys = count(1)
        self.token_s = self._time_one_token()

    def _time_one_token(self, calls: int = 5) -> float:
        """Seconds one draft token costs, measured once now (a drafter starts from it, so auto K
        knows from its first step whether drafts can pay: a draft model as dear as the target
        never can on a fast link, and then is never even tried)."""
        kv, took = self.kv(0), []
        try:
            for _ in range(calls):
                start = time.perf_counter()
                kv.feed([0])
                took.append(time.perf_counter() - start)
        finally:
            kv.close()
        return float(np.median(took[1:]))  # the first call warms the request up

    def kv(self, key: int) -> PagedKv | KeyedKv:
        """A drafter's own KV on this model, of the export's kind."""
        return PagedKv(self) if self.paged is not None else KeyedKv(self, key)

    def drafter(self) -> ModelDrafter:
        return ModelDrafter(self, next(self._keys))


class PagedKv:
    """A drafter's KV as a block table over the paged draft's one pool: `past` tokens held."""

    def __init__(self, model: DraftModel) -> None:
        assert model.paged is not None
        self.model, self.runner, self.table, self.past = model, model.paged, list[int](), 0

    @property
    def position(self) -> int:
        return self.past

    def feed(self, tokens: list[int]) -> np.ndarray:
        """`tokens` after the past (in chunks): the logits after the last. Blocks are taken from
        the pool first; ShardlineError, nothing changed, when it has too few."""
        size = self.runner.block_size
        for at in range(0, len(tokens), CATCH_UP_CHUNK):
            chunk = tokens[at: at + CATCH_UP_CHUNK]
            need = -(-(self.past + len(chunk)) // size) - len(self.table)
            if need > len(self.model.free):
                raise ShardlineError(f"the draft model's pool has {len(self.model.free)} free blocks; "
                                     f"{need} more are needed")
            self.table += [self.model.free.pop() for _ in range(need)]
            batch = PagedBatch.of([(len(chunk), self.past, self.table)], logits_at=[len(chunk) - 1])
            out = self.runner.run(batch, np.asarray(chunk, np.int64))
            self.past += len(chunk)
        return np.array(out[0], np.float32)

    def drop(self, n: int) -> None:
        """The last `n` tokens gone: a shorter past, the blocks past it back to the pool."""
        self.past -= n
        keep = -(-self.past // self.runner.block_size)
        self.model.free += self.table[keep:]
        del self.table[keep:]

    def close(self) -> None:
        self.drop(self.past)


class KeyedKv:
    """A drafter's KV as a request of a stateful draft: rejected drafts masked (KVBook), the
    cache compacted once enough are."""

    def __init__(self, model: DraftModel, key: int) -> None:
        assert model.runner is not None
        self.runner, self.key, self.book = model.runner, key, KVBook()
        self.runner.open(key)

    @property
    def position(self) -> int:
        return self.book.position

    def feed(self, tokens: list[int]) -> np.ndarray:
        for at in range(0, len(tokens), CATCH_UP_CHUNK):
            inputs = self.book.plan(tokens[at: at + CATCH_UP_CHUNK])
            out = self.runner.run(self.key, inputs)
            self.book.commit(inputs)
        return np.asarray(out[0, -1], np.float32)

    def drop(self, n: int) -> None:
        self.book.mask_last(n)
        if self.book.masked >= COMPACT_AT:
            slots = self.book.slots
            self.runner.compact(self.key, self.book.compact(), slots)

    def close(self) -> None:
        self.runner.close(self.key)


class ModelDrafter:
    """A stream's drafts from the draft model. Its KV holds the stream's accepted text (`fed`
    tokens) and then `pending`: drafts fed but not yet accepted. `drafts` is the chain drawn past
    the accepted text: `pending` and the newest draw (fed only when the next is drawn).

    The chain may run past the drafts in flight (`follow`, while remote stages verify them): the
    first extra draft guesses the target's own next token. When every draft in flight stood and
    the target chose that guess, the drafts after it are ready for the next step at no cost;
    otherwise `_sync` masks what the target did not accept, like the target's stages do."""

    def __init__(self, model: DraftModel, key: int) -> None:
        self.model, self.key = model, key
        self.kv = model.kv(key)
        self.fed = 0  # tokens of the stream's context in the draft's KV (attended)
        self.drafts: list[Draw] = []
        self.pending = 0  # drafts[:pending] are in the KV, after the `fed` tokens
        self.cost_s = model.token_s
        self._logits: np.ndarray | None = None  # after the KV's last token, until drawn from

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        with self.model.lock:
            self._sync(context)
            while len(self.drafts) < k:
                self._extend(params)
        return proposal(self.drafts[:k], params)

    def ready(self, context: list[int]) -> int:
        """Drafts that would follow `context` without drawing any (drawn ahead earlier)."""
        new = context[self.fed:]
        return len(self.drafts) - len(new) if self._follows(new) else 0

    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool:
        """Idle time (the stream's step is out on remote stages): catch up with the accepted
        text `context` if behind (a stream that offered no drafts lately), else draw one more
        draft past the chain, up to `limit` in all. Whether the draft model ran."""
        with self.model.lock:
            behind = not self._follows(context[self.fed:])
            self._sync(context)
            if behind:
                return True
            if len(self.drafts) >= limit or (not self.drafts and self._logits is None):
                return False
            self._extend(params)
        return True

    def close(self) -> None:
        with self.model.lock:
            self.kv.close()

    def _follows(self, new: list[int]) -> bool:
        """Whether the accepted tokens `new` (past `fed`) are all drafts already in the KV."""
        return len(new) <= self.pending and all(d.token == t for d, t in zip(self.drafts, new, strict=False))

    def _sync(self, context: list[int]) -> None:
        """Make the KV hold `context` (which extends the accepted text) and the drafts that still
        follow it: pending drafts the target accepted stay, the rest are dropped."""
        new = context[self.fed:]
        if self._follows(new):
            self.fed, self.pending, self.drafts = len(context), self.pending - len(new), self.drafts[len(new):]
            return
        same = 0
        while same < min(len(new), self.pending) and self.drafts[same].token == new[same]:
            same += 1
        self.kv.drop(self.pending - same)
        self.drafts, self.pending = [], 0
        self._logits = self._feed(new[same:])
        self.fed = len(context)

    def _extend(self, params: SamplingParams) -> None:
        """Draw the next draft (feeding the newest first: drafts are conditioned on each other)."""
        if self.drafts:
            logits = self._feed([self.drafts[-1].token])
            self.pending += 1
        elif self._logits is not None:
            logits, self._logits = self._logits, None
        else:
            raise ShardlineError("the draft model has nothing to draw from")
        self.drafts.append(draw(logits, params, self.kv.position))

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Run `tokens` through the draft model; the logits after the last. A call of one token
        is what each draft costs (`cost_s`); catching up on a prompt is not."""
        if not tokens:
            raise ShardlineError("nothing to feed the draft model")
        start = time.perf_counter()
        logits = self.kv.feed(tokens)
        if len(tokens) == 1:
            took = time.perf_counter() - start
            self.cost_s = took if not self.cost_s else 0.8 * self.cost_s + 0.2 * took
        return logits
