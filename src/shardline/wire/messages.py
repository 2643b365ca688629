"""The closed set of messages that travel between coordinator and stage workers (protocol 14).

Every message is a frozen dataclass with a fixed kind number. Scalar fields travel as JSON and
are checked against their declared types on decode (an int is not a bool, an enum takes only
its values, a nested SamplingParams is checked field by field). Array fields carry explicit
dtype and shape; `ARRAYS` says which dtypes and how many dimensions each may have, and each
message's `__post_init__` checks how the shapes fit together and the ranges of ids. A frame that
fails any check is refused by the codec before any of it reaches a stage (see codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import numpy as np

from shardline.config import MAX_CONTEXT, SamplingParams
from shardline.errors import Unsampleable

# 2: Forward and Sampled carry `hops`; 3: rows (decode groups); 4: multi-token steps with
# chosen sample positions, explicit first step, run-length masks, typed sampling, sessions;
# 5: `compact` (speculation drops masked slots), verify draws against a draft distribution;
# 6: a key's KV moves over the coordinator's links (KvPull, KvPush, KvPart, KvDone);
# 7: KvPull.start, the slots from which a pull copies (chunk-level KV transfer);
# 8: Hello.context, the longest sequence the sender serves; 9: Hello.device, where its stages run;
# 10: KvCopy, a lease's slots copied into a new one on the worker (prefix reuse);
# 11: what a frame may cost bounded (a key opens with one row: a first step, a push; a copy's
# slots increasing), Ping/Pong on idle links; 12: Forward.allow_bits/allow_of, the tokens a
# constrained entry may take (issue 40); 13: Ragged, a paged step (issue 41): every stream's new
# tokens in one flat batch over block tables; Hello.block_size and Hello.blocks (the pool);
# 14: KvPull.blocks/tokens and KvPush.blocks, a paged stream's KV moved by its blocks;
# 15: Sampled.failed, the entries no token could be chosen for (their streams fail alone).
PROTOCOL = 15
MAX_SUPPORT = 64  # token ids of a draft distribution sent per sampled position

# One row of `hops` per stage a step has run through, appended by the process that ran it:
# durations in seconds on that process's own clock (clocks of different machines never mix).
# Decode, host and encode belong to the process, not the stage: a process that runs several
# stages puts them on its last row (zeros on the others). Host is the time from the incoming
# frame decoded to the outgoing frame's encode started, minus graph time (queueing included).
# Encode is stamped by the codec into the last f64 of the frame (see codec.encode), so a
# sender's own row is always the last one. Stage -1 marks a coordinator relaying (star).
HOP_COLUMNS = ("stage", "graph_s", "decode_s", "host_s", "encode_s")
RELAY = -1

# Bounds every peer enforces on a step (far above what serving uses; they bound memory).
MAX_ROWS = 256  # rows of one step
MAX_STEP_TOKENS = 1 << 16  # new tokens per row in one step
MAX_SLOTS = 1 << 20  # attention mask width (physical cache slots + new tokens)
MAX_HOPS = 1024
MAX_KV_PARTS = 1 << 12  # state variables of one worker's stages in one KV move (two per layer)
MAX_NAME = 256  # a state variable's name
MAX_MASK_WORDS = (1 << 20) // 32  # a token mask's i32 words: a vocabulary of up to 2^20 tokens
MAX_BLOCKS = 1 << 24  # KV blocks of a paged pool (a block holds 16-256 tokens of every layer)


class Role(StrEnum):
    COORDINATOR = "coordinator"
    WORKER = "worker"


class Activations(StrEnum):
    """Dtype of hidden states on a link; a worker accepts either ("any")."""

    F16 = "f16"
    F32 = "f32"
    ANY = "any"


class Phase(StrEnum):
    PREFILL = "prefill"  # a chunk of one stream's prompt
    DECODE = "decode"  # generated (or drafted) tokens of one stream or of a decode group's rows


@dataclass(frozen=True)
class Arr:
    """What an array field may be: its dtypes, its number of dimensions, whether it may be absent."""

    dtypes: tuple[str, ...]
    ndim: int
    optional: bool = False


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


# Below this many elements, checks run on Python lists: numpy's per-call overhead (a few us for
# min, max or unique) made these checks most of a decode step's frame decoding (63 vs 31 us).
_SMALL = 64


def _range(a: np.ndarray) -> tuple[int, int] | None:
    """(min, max) of an int array, None when it is empty."""
    if a.size == 0:
        return None
    if a.size <= _SMALL:
        v = a.ravel().tolist()
        return min(v), max(v)
    return int(a.min()), int(a.max())


def _ids_in(a: np.ndarray, n: int, what: str) -> None:
    r = _range(a)
    _need(r is None or (r[0] >= 0 and r[1] < n), f"{what} out of range 0-{n - 1}")


def _check_blocks(blocks: np.ndarray, what: str) -> None:
    """A paged move's blocks: some, distinct, ids a pool may have (its own size is the worker's)."""
    _need(1 <= blocks.size <= MAX_BLOCKS, f"{what}: {blocks.size} blocks")
    _ids_in(blocks, MAX_BLOCKS, f"{what}.blocks")
    _need(_distinct(blocks), f"{what}: a block twice")


def _increasing(a: np.ndarray) -> bool:
    return bool((a[1:] > a[:-1]).all())


def _distinct(a: np.ndarray) -> bool:
    return len(set(a.tolist())) == a.size if a.size <= _SMALL else len(np.unique(a)) == a.size


@dataclass(frozen=True)
class Hello:
    """First message on a link, both ways: who I am and what I serve (checked by the peer).
    `session` names the coordinator's chain: a coordinator picks it at random; a worker's link to
    the next worker carries its coordinator's, so the next worker knows whose chain it belongs
    to (streams live per session: no coordinator sees another's)."""

    KIND: ClassVar[int] = 1
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    protocol: int
    role: Role
    model_hash: str
    first_layer: int  # the layers the sender runs (coordinator: its own stage 0)
    last_layer: int
    weights: str
    activations: Activations
    session: str  # 32 hex digits; "" in a worker's answer
    # The longest sequence the sender serves (RunConfig.context resolved): a chain's nodes must
    # agree, or the coordinator admits streams that a worker refuses halfway.
    context: int
    # The OpenVINO device of each of the sender's stages, comma-separated (for people: the
    # fleet page); "" when it does not say.
    device: str = ""
    # Paged stages (issue 41): the tokens of a KV block the sender's device chose (0: its stages
    # are not paged); a coordinator's `blocks` is its session's pool, which every worker of the
    # chain allocates for it (one block table serves every stage), 0 in a worker's answer.
    block_size: int = 0
    blocks: int = 0

    def __post_init__(self) -> None:
        _need(0 <= self.block_size <= 1 << 16 and 0 <= self.blocks <= MAX_BLOCKS,
              f"Hello: blocks of {self.block_size} tokens, a pool of {self.blocks}")
        _need(len(self.model_hash) <= 128 and len(self.weights) <= 32 and len(self.session) <= 64,
              "oversized Hello field")
        _need(len(self.device) <= 256 and self.device.isprintable(), "oversized or unprintable Hello.device")
        _need(0 <= self.first_layer <= self.last_layer < 1 << 16, "bad layer range")
        _need(1 <= self.context <= MAX_CONTEXT, f"context {self.context} outside 1-{MAX_CONTEXT}")


@dataclass(frozen=True)
class Refuse:
    """Sent instead of a reply when the peer's request cannot be served; the link then closes.
    The reason is for people."""

    KIND: ClassVar[int] = 2
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    reason: str


# In a worker's Refuse: what it lost is the next worker of the chain, not itself.
LOST_NEXT = "lost the next worker"


@dataclass(frozen=True)
class StepFailed:
    """A step that could not run (an unknown key, a shape that does not fit the cache): its rows
    fail, the link and every other stream go on."""

    KIND: ClassVar[int] = 3
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    key: int
    seq: int
    reason: str


@dataclass(frozen=True)
class Release:
    """Free what every stage holds under `key` (a stream's or a decode group's KV)."""

    KIND: ClassVar[int] = 4
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    key: int


@dataclass(frozen=True)
class Forward:
    """One step, hidden states in: of one stream (one row), or of a decode group (one row per
    stream, see serving/groups.py). Every row carries T new tokens; the end of the chain returns
    a token (and its log-probability) for each (row, t) of `sample_at`, in that order: the next
    token after new token t of that row. A prompt chunk that is not the last samples nothing.

    The mask is sent as runs of ones over `slots` columns (the physical cache plus the T new
    slots); columns outside every run are 0 (never attended: left padding, rejected drafts)."""

    KIND: ClassVar[int] = 5
    ARRAYS: ClassVar[dict[str, Arr]] = {
        "rows": Arr(("i8",), 1), "keep": Arr(("i8",), 1), "merge": Arr(("i8",), 1),
        "hidden": Arr(("f2", "f4"), 3), "mask_runs": Arr(("i4",), 2), "position_ids": Arr(("i8",), 2),
        "sample_at": Arr(("i8",), 2), "drafts": Arr(("i8",), 1, True), "q_ids": Arr(("i8",), 2, True),
        "q_probs": Arr(("f4",), 2, True), "allow_bits": Arr(("i4",), 2, True), "allow_of": Arr(("i8",), 1, True),
        "hops": Arr(("f8",), 2),
    }
    key: int  # the key the stages' requests are open under: the stream, or the group's key
    seq: int  # step number, echoed in the reply
    phase: Phase
    first: bool  # the key's first step: every stage opens a fresh request (empty cache) for it
    slots: int  # width of the attention mask
    want_logits: bool  # also return the whole logits row of every sampled position
    # Before the step every stage drops the slots the mask (over the cache as it is) never
    # attends again, then runs the step over the compacted cache (stage.cache.compaction).
    compact: bool
    sampling: list[SamplingParams]  # per row (used by the last stage)
    rows: np.ndarray  # [B] i64: the stream of each row
    keep: np.ndarray  # [K] i64: before the step, the rows of the KV state kept, in order
    merge: np.ndarray  # [M] i64: before the step, streams whose own KV is appended after them
    hidden: np.ndarray  # [B, T, hidden] f16 or f32
    mask_runs: np.ndarray  # [R, 3] i32: (row, first column, length) of each run of ones
    position_ids: np.ndarray  # [B, T] i64: logical positions (RoPE)
    sample_at: np.ndarray  # [E, 2] i64: (row, t) whose next token is wanted
    # Speculative sampling with a draft drawn from a distribution q (None when no entry has one:
    # greedy, or drafts that are certain, need nothing): per entry the draft offered (-1: none)
    # and q's support, padded with id -1 / probability 0. See decoding/speculative.py.
    drafts: np.ndarray | None  # [E] i64
    q_ids: np.ndarray | None  # [E, S] i64
    q_probs: np.ndarray | None  # [E, S] f32
    # Constrained decoding (decoding/masks.py): per entry the row of allow_bits that limits it
    # (-1: free); a row is a bitmask over the vocabulary, 32 tokens per i32 word. Both or neither.
    allow_bits: np.ndarray | None  # [M, W] i32
    allow_of: np.ndarray | None  # [E] i64
    hops: np.ndarray  # [stages so far, len(HOP_COLUMNS)] f64; must stay the last array field

    def __post_init__(self) -> None:
        b, t = self.hidden.shape[0], self.hidden.shape[1]
        _need(1 <= b <= MAX_ROWS and 1 <= t <= MAX_STEP_TOKENS, f"hidden of shape {self.hidden.shape}")
        _need(t <= self.slots <= MAX_SLOTS, f"mask width {self.slots} for {t} new tokens")
        _need(self.rows.shape == (b,) and len(self.sampling) == b, "one stream and one sampling per row")
        _need(self.position_ids.shape == (b, t), f"position_ids {self.position_ids.shape}, hidden {(b, t)}")
        _ids_in(self.position_ids, MAX_SLOTS, "positions")
        _need(self.mask_runs.shape[1:] == (3,) and self.sample_at.shape[1:] == (2,), "mask runs or samples")
        _need(self.hops.shape[1:] == (len(HOP_COLUMNS),) and self.hops.shape[0] <= MAX_HOPS, "hops")
        check_runs(self.mask_runs, b, self.slots)
        _ids_in(self.sample_at[:, 0], b, "sample row")
        _ids_in(self.sample_at[:, 1], t, "sample position")
        _need(self.sample_at.shape[0] <= b * t, "more samples than positions")
        _need(_distinct(self.rows), "a stream twice in one step")
        # A key opens with one row (rows join a group only by a merge of open keys): no frame
        # makes a worker hold more than one new row (node/bounds.py).
        _need(not self.first or b == 1, f"Forward.rows: a key's first step opens one row, not {b}")
        # keep and merge both empty: the state's rows as they are; keep alone: those rows (the
        # others dropped); merge: the kept rows, then the merged streams' own states.
        _need(b == self.keep.size + self.merge.size or (self.keep.size == 0 and self.merge.size == 0),
              f"{b} rows, {self.keep.size} kept and {self.merge.size} merged")
        _ids_in(self.keep, MAX_ROWS, "kept row")  # that it exists is checked against the state (node/)
        _need(_distinct(self.keep) and _distinct(self.merge),
              "a row kept or merged twice")
        check_drafts(self.drafts, self.q_ids, self.q_probs, self.sample_at.shape[0])
        check_allowed(self.allow_bits, self.allow_of, self.sample_at.shape[0])
        _need(not self.compact or (self.keep.size == 0 and self.merge.size == 0 and not self.first),
              "a step that opens, merges or drops rows cannot also compact")


def check_allowed(bits: np.ndarray | None, which: np.ndarray | None, e: int) -> None:
    """Token masks come with the entries they limit, one per sampled entry, naming rows that exist."""
    if bits is None and which is None:
        return
    _need(bits is not None and which is not None, "allow_bits come with allow_of")
    assert bits is not None and which is not None
    _need(which.shape == (e,), f"allow_of {which.shape} for {e} samples")
    _need(bits.shape[0] <= e and bits.shape[1] <= MAX_MASK_WORDS, f"token masks of shape {bits.shape} for {e} samples")
    r = _range(which)
    _need(r is None or (r[0] >= -1 and r[1] < bits.shape[0]), f"allow_of names a mask outside 0-{bits.shape[0] - 1}")


def check_drafts(drafts: np.ndarray | None, q_ids: np.ndarray | None, q_probs: np.ndarray | None, e: int) -> None:
    """Drafts and their distributions' supports go together, one per sampled entry; a draft is
    offered only with a probability > 0 (the last stage checks the ids against its vocabulary)."""
    if drafts is None and q_ids is None and q_probs is None:
        return
    _need(drafts is not None and q_ids is not None and q_probs is not None, "drafts come with their q support")
    assert drafts is not None and q_ids is not None and q_probs is not None
    _need(drafts.shape == (e,) and q_ids.shape == q_probs.shape and q_ids.shape[0] == e
          and q_ids.shape[1] <= MAX_SUPPORT, f"drafts {drafts.shape}, q {q_ids.shape}/{q_probs.shape} for {e} samples")
    _need(bool(np.isfinite(q_probs).all()) and (q_probs.size == 0 or (q_probs.min() >= 0 and q_probs.max() <= 1)),
          "q probabilities outside 0-1")
    _need((drafts.size == 0 or drafts.min() >= -1) and (q_ids.size == 0 or q_ids.min() >= -1), "negative token ids")
    for d, ids, ps in zip(drafts.tolist(), q_ids.tolist(), q_probs.tolist(), strict=True):
        _need(d < 0 or any(i == d and p > 0 for i, p in zip(ids, ps, strict=True)),
              f"draft {d} offered outside its q support")


@dataclass(frozen=True)
class Sampled:
    """The last stage's answer to a Forward: for each entry of its `sample_at`, in that order, the
    chosen token and its log-probability (temperature 1), the top alternatives when a row asked
    for them (padded with -1 / -inf to the widest row), and the logits only when asked for.
    `failed`, when some entry could not be sampled: per entry -1, or the code of why not
    (decoding/masks.Unsampleable.REASONS; its token is -1): that entry's stream fails alone."""

    KIND: ClassVar[int] = 6
    ARRAYS: ClassVar[dict[str, Arr]] = {
        "tokens": Arr(("i8",), 1), "logprobs": Arr(("f4",), 1), "top_ids": Arr(("i8",), 2, True),
        "top_logprobs": Arr(("f4",), 2, True), "logits": Arr(("f4",), 2, True), "failed": Arr(("i4",), 1, True),
        "hops": Arr(("f8",), 2),
    }
    key: int
    seq: int
    tokens: np.ndarray  # [E] i64
    logprobs: np.ndarray  # [E] f32
    top_ids: np.ndarray | None  # [E, n] i64
    top_logprobs: np.ndarray | None  # [E, n] f32
    logits: np.ndarray | None  # [E, vocab] f32
    failed: np.ndarray | None  # [E] i32: -1, or why entry e has no token
    hops: np.ndarray  # every stage's row, the last worker's last: see HOP_COLUMNS

    def __post_init__(self) -> None:
        e = self.tokens.shape[0]
        if self.failed is not None:
            _need(self.failed.shape == (e,), "one failure code per token")
            r = _range(self.failed)
            _need(r is None or (r[0] >= -1 and r[1] < len(Unsampleable.REASONS)), "failure codes out of range")
        _need(self.logprobs.shape == (e,), "one logprob per token")
        _need((self.top_ids is None) == (self.top_logprobs is None), "top ids and logprobs go together")
        if self.top_ids is not None and self.top_logprobs is not None:
            _need(self.top_ids.shape == self.top_logprobs.shape and self.top_ids.shape[0] == e, "top shapes")
        _need(self.logits is None or self.logits.shape[0] == e, "one logits row per token")
        _need(self.hops.shape[1:] == (len(HOP_COLUMNS),) and self.hops.shape[0] <= MAX_HOPS, "hops")


@dataclass(frozen=True)
class ShardRequest:
    """A worker asks the coordinator for one file of its shard, during the handshake (before the
    worker's Hello); the answer is ShardChunk frames in order, or a Refuse (see node/delivery.py)."""

    KIND: ClassVar[int] = 7
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    name: str


@dataclass(frozen=True)
class ShardChunk:
    """One piece of a requested file: chunks come in order, offset 0 first, until offset + size
    reaches total (a file of 0 bytes is one empty chunk)."""

    KIND: ClassVar[int] = 8
    ARRAYS: ClassVar[dict[str, Arr]] = {"data": Arr(("u1",), 1)}
    name: str
    offset: int
    total: int
    sha256: str  # of the whole file, as in the manifest
    data: np.ndarray  # u8

    def __post_init__(self) -> None:
        _need(self.offset >= 0 and self.offset + self.data.size <= self.total, "chunk outside its file")


@dataclass(frozen=True)
class Route:
    """Coordinator -> worker: where this worker's output goes. `next` is the next worker's
    HOST:PORT (a daisy chain); empty means back to the coordinator on this link (the end of the
    chain, or every worker in a star)."""

    KIND: ClassVar[int] = 9
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    next: str


def check_runs(runs: np.ndarray, rows: int, width: int) -> None:
    """Runs (row, start, length) inside [0, rows) x [0, width), in order, not touching each other."""
    _need(runs.shape[0] <= MAX_SLOTS, "too many mask runs")
    if runs.size == 0:
        return
    if runs.shape[0] <= _SMALL:
        return _check_few_runs(runs.tolist(), rows, width)
    r, start, length = runs[:, 0].astype(np.int64), runs[:, 1].astype(np.int64), runs[:, 2].astype(np.int64)
    _need(bool((r >= 0).all() and (r < rows).all() and (start >= 0).all() and (length >= 1).all()
               and (start + length <= width).all()), "mask run outside the mask")
    same_row = r[1:] == r[:-1]
    _need(bool((r[1:] >= r[:-1]).all() and (start[1:][same_row] > (start + length)[:-1][same_row]).all()),
          "mask runs out of order or touching")


def _check_few_runs(runs: list[list[int]], rows: int, width: int) -> None:
    """check_runs for a handful of runs (a mask has one or two per row until speculation)."""
    prev_row, prev_end = -1, -1
    for r, start, length in runs:
        _need(0 <= r < rows and start >= 0 and length >= 1 and start + length <= width, "mask run outside the mask")
        _need(r > prev_row or start > prev_end, "mask runs out of order or touching")
        prev_row, prev_end = r, start + length


def mask_to_runs(mask: np.ndarray) -> np.ndarray:
    """[B, S] of 0/1 -> [R, 3] i32 runs of ones (row, start, length), in row then column order."""
    padded = np.zeros((mask.shape[0], mask.shape[1] + 2), np.int8)
    padded[:, 1:-1] = mask != 0
    edges = np.diff(padded, axis=1)
    rows, starts = np.nonzero(edges == 1)
    _, stops = np.nonzero(edges == -1)  # same row order: every run that opens also closes
    return np.stack([rows, starts, stops - starts], axis=1).astype(np.int32)


def runs_to_mask(runs: np.ndarray, rows: int, width: int) -> np.ndarray:
    """The [rows, width] i64 mask the graphs take, from checked runs."""
    edges = np.zeros((rows, width + 1), np.int64)
    r, start = runs[:, 0], runs[:, 1]
    edges[r, start] = 1  # runs never touch: no start is another run's end
    edges[r, start + runs[:, 2]] = -1
    return np.cumsum(edges, axis=1)[:, :width]


# --- a key's KV over the coordinator's link (pipeline/remote_kv.py, node/kv.py) -----------------
# One KvPart per state variable keeps every frame one layer's K or V. Each worker applies these in
# the order they arrive on its coordinator's link, with that link's Release: a pull sees every
# step its coordinator finished before, a push opens the key before any later step needs it.


def _check_seq(seq: int) -> None:
    _need(seq >= 0, f"negative seq {seq}")


@dataclass(frozen=True)
class KvPull:
    """Coordinator -> worker: a copy of `key`'s KV from slot `start` on, on each of its stages
    (the key stays open). The answer: a KvPart per state variable, then a KvDone (its error says
    why none, e.g. an unknown key or a start past its slots). `key` is any key a step may hold
    (a decode group's are negative). On a paged chain (protocol 14) the KV of the first `tokens`
    tokens held in `blocks` of the session's pools instead, as one row of that many slots."""

    KIND: ClassVar[int] = 10
    ARRAYS: ClassVar[dict[str, Arr]] = {"blocks": Arr(("i4",), 1, True)}
    seq: int
    key: int
    start: int = 0  # the first slot copied: the slots a chunk-level transfer has not sent yet
    blocks: np.ndarray | None = None  # [B] i32, a paged stream's blocks in order
    tokens: int = 0  # a paged pull's: how many tokens of them

    def __post_init__(self) -> None:
        _check_seq(self.seq)
        _need(0 <= self.start <= MAX_SLOTS, f"a start slot of {self.start}")
        if self.blocks is None:
            _need(self.tokens == 0, "KvPull.tokens without blocks")
            return
        _check_blocks(self.blocks, "KvPull")
        _need(self.start == 0, "KvPull: a paged pull starts at slot 0")
        _need(self.blocks.size <= self.tokens <= MAX_SLOTS,
              f"KvPull: {self.tokens} tokens in {self.blocks.size} blocks")


@dataclass(frozen=True)
class KvPush:
    """Coordinator -> worker: open `key` on every stage of the worker with the state of the
    `parts` KvParts that follow (same seq): `rows` rows of `slots` slots each. Answered by a
    KvDone once the last part is in (its error says why nothing was opened). On a paged chain
    (protocol 14) the `slots` tokens go into `blocks` of the session's pools instead."""

    KIND: ClassVar[int] = 11
    ARRAYS: ClassVar[dict[str, Arr]] = {"blocks": Arr(("i4",), 1, True)}
    seq: int
    key: int
    rows: int
    slots: int
    parts: int
    blocks: np.ndarray | None = None  # [B] i32, the blocks a paged stream's tokens are written into

    def __post_init__(self) -> None:
        _check_seq(self.seq)
        # One row, as a first step opens (a stream's KV; a group's is made by merges, never pushed).
        _need(self.rows == 1 and 0 <= self.slots <= MAX_SLOTS, f"KvPush: {self.rows} rows of {self.slots} slots "
              f"(a push opens one row of at most {MAX_SLOTS})")
        _need(1 <= self.parts <= MAX_KV_PARTS, f"{self.parts} parts")
        if self.blocks is not None:
            _check_blocks(self.blocks, "KvPush")
            _need(1 <= self.blocks.size <= self.slots, f"KvPush: {self.slots} tokens in {self.blocks.size} blocks")


@dataclass(frozen=True)
class KvPart:
    """One state variable of the stage that runs layers first-last: worker -> coordinator for a
    pull, coordinator -> worker for a push."""

    KIND: ClassVar[int] = 12
    ARRAYS: ClassVar[dict[str, Arr]] = {"state": Arr(("f4", "f2"), 4)}
    seq: int
    first_layer: int
    last_layer: int
    name: str
    state: np.ndarray  # [rows, kv_heads, slots, head_dim]

    def __post_init__(self) -> None:
        _check_seq(self.seq)
        _need(0 <= self.first_layer <= self.last_layer < 1 << 16, "bad layer range")
        _need(1 <= len(self.name) <= MAX_NAME, "a state name of 1-256 characters")
        rows, heads, slots, dim = self.state.shape
        _need(1 <= rows <= MAX_ROWS and heads >= 1 and slots <= MAX_SLOTS and dim >= 1,
              f"a KV state of shape {list(self.state.shape)}")


@dataclass(frozen=True)
class KvDone:
    """Worker -> coordinator: the end of a pull (`parts` sent) or the result of a push (`parts`
    taken); `error` is empty when it went well, else why (for people)."""

    KIND: ClassVar[int] = 13
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    seq: int
    parts: int
    error: str

    def __post_init__(self) -> None:
        _check_seq(self.seq)
        _need(0 <= self.parts <= MAX_KV_PARTS, f"{self.parts} parts")


@dataclass(frozen=True)
class KvCopy:
    """Coordinator -> worker: open `dst` on every stage of the worker with the slots `index` (in
    order) of row `row` of `src`'s state, which stays as it is (prefix reuse: a kept prefix into
    a new stream's key, an ended stream's KV into an entry's). Answered by a KvDone of no parts;
    its error says why nothing was opened (an unknown `src`, a row or slot it lacks, `dst` open)."""

    KIND: ClassVar[int] = 14
    ARRAYS: ClassVar[dict[str, Arr]] = {"index": Arr(("i8",), 1)}
    seq: int
    src: int
    dst: int
    row: int
    index: np.ndarray  # [W] i64: slots of `src`

    def __post_init__(self) -> None:
        _check_seq(self.seq)
        _need(0 <= self.row < MAX_ROWS, f"row {self.row}")
        _need(1 <= self.index.size <= MAX_SLOTS, f"KvCopy.index: {self.index.size} slots")
        _ids_in(self.index, MAX_SLOTS, "KvCopy.index: slots")
        # Increasing, so distinct: a copy holds no more slots than its source (node/bounds.py).
        _need(_increasing(self.index), "KvCopy.index: slots not strictly increasing")
        _need(self.src != self.dst, "a copy of a key into itself")


@dataclass(frozen=True)
class Ping:
    """Coordinator -> worker on a link that has been quiet: answered at once with a Pong by the
    link's reader (not queued behind steps), so a worker that stopped is seen with no traffic."""

    KIND: ClassVar[int] = 15
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    seq: int

    def __post_init__(self) -> None:
        _check_seq(self.seq)


@dataclass(frozen=True)
class Pong:
    """Worker -> coordinator: the answer to the Ping of the same seq."""

    KIND: ClassVar[int] = 16
    ARRAYS: ClassVar[dict[str, Arr]] = {}
    seq: int

    def __post_init__(self) -> None:
        _check_seq(self.seq)


@dataclass(frozen=True)
class Ragged:
    """One step of a paged chain (issue 41), hidden states in: the new tokens of S sequences end to
    end (decode tokens and prompt chunks fused), each over its block table in the session's pool.
    The end of the chain returns a Sampled with a token for each (sequence, t) of `sample_at`.

    Checked here: the shapes fit together, the starts cover the batch in order, the ids and
    positions are in range. Checked by each worker against its pool before any stage runs
    (stage/paged_batch.py): positions that follow each past, tables whose blocks are inside the
    pool and cover their tokens, no block written by one sequence and in another's table, the
    context; a step that fails is refused with the pool unchanged."""

    KIND: ClassVar[int] = 17
    ARRAYS: ClassVar[dict[str, Arr]] = {
        "streams": Arr(("i8",), 1), "hidden": Arr(("f2", "f4"), 2), "positions": Arr(("i8",), 1),
        "past_lens": Arr(("i4",), 1), "begins": Arr(("i4",), 1), "block_indices": Arr(("i4",), 1),
        "block_begins": Arr(("i4",), 1), "sample_at": Arr(("i8",), 2), "drafts": Arr(("i8",), 1, True),
        "q_ids": Arr(("i8",), 2, True), "q_probs": Arr(("f4",), 2, True), "allow_bits": Arr(("i4",), 2, True),
        "allow_of": Arr(("i8",), 1, True), "hops": Arr(("f8",), 2),
    }
    seq: int
    phase: Phase
    want_logits: bool
    sampling: list[SamplingParams]  # per sequence
    streams: np.ndarray  # [S] i64: each sequence's stream
    hidden: np.ndarray  # [T, hidden] f16 or f32: every new token, sequence after sequence
    positions: np.ndarray  # [T] i64: each token's position in its sequence (past_lens on)
    past_lens: np.ndarray  # [S] i32: tokens each sequence's blocks hold already
    begins: np.ndarray  # [S + 1] i32: where each sequence's tokens start
    block_indices: np.ndarray  # [N] i32: the block tables end to end
    block_begins: np.ndarray  # [S + 1] i32: where each sequence's table starts
    sample_at: np.ndarray  # [E, 2] i64: (sequence, t) whose next token is wanted
    drafts: np.ndarray | None  # [E] i64, as Forward's
    q_ids: np.ndarray | None  # [E, S] i64
    q_probs: np.ndarray | None  # [E, S] f32
    allow_bits: np.ndarray | None  # [M, W] i32
    allow_of: np.ndarray | None  # [E] i64
    hops: np.ndarray  # as Forward's; must stay the last array field

    def __post_init__(self) -> None:
        t, s = self.hidden.shape[0], self.streams.shape[0]
        _need(1 <= s <= MAX_ROWS and s <= t <= MAX_STEP_TOKENS, f"Ragged: {s} sequences, hidden {self.hidden.shape}")
        _need(len(self.sampling) == s and self.past_lens.shape == (s,), "one sampling and past length per sequence")
        _need(self.begins.shape == (s + 1,) and self.block_begins.shape == (s + 1,),
              "Ragged: starts of tokens and of tables number one more than the sequences")
        _need(self.positions.shape == (t,), f"positions {self.positions.shape} for {t} tokens")
        _need(self.begins[0] == 0 and self.begins[-1] == t and bool((self.begins[1:] > self.begins[:-1]).all()),
              "Ragged.begins: each sequence takes at least one token, and they cover the batch")
        n = self.block_indices.shape[0]
        _need(self.block_begins[0] == 0 and self.block_begins[-1] == n
              and bool((self.block_begins[1:] >= self.block_begins[:-1]).all()), "Ragged.block_begins out of order")
        _ids_in(self.block_indices, MAX_BLOCKS, "Ragged.block_indices")
        _ids_in(self.past_lens, MAX_CONTEXT, "Ragged.past_lens")
        _ids_in(self.positions, MAX_CONTEXT, "Ragged.positions")
        _need(_distinct(self.streams), "a stream twice in one step")
        _need(self.sample_at.shape[1:] == (2,) and self.sample_at.shape[0] <= t, "Ragged.sample_at")
        _ids_in(self.sample_at[:, 0], s, "sample sequence")
        lengths = np.diff(self.begins)
        _need(all(0 <= x < int(lengths[q]) for q, x in self.sample_at.tolist()), "a sample past its sequence's tokens")
        _need(self.hops.shape[1:] == (len(HOP_COLUMNS),) and self.hops.shape[0] <= MAX_HOPS, "hops")
        check_drafts(self.drafts, self.q_ids, self.q_probs, self.sample_at.shape[0])
        check_allowed(self.allow_bits, self.allow_of, self.sample_at.shape[0])


Message = (Hello | Refuse | StepFailed | Release | Forward | Sampled | ShardRequest | ShardChunk | Route | KvPull
           | KvPush | KvPart | KvDone | KvCopy | Ping | Pong | Ragged)
MESSAGES: dict[int, type] = {m.KIND: m for m in (Hello, Refuse, StepFailed, Release, Forward, Sampled,
                                                 ShardRequest, ShardChunk, Route, KvPull, KvPush, KvPart, KvDone,
                                                 KvCopy, Ping, Pong, Ragged)}
