"""One record per stream: everything the engine and the scheduler know about a request that
holds KV on the stages (its prompt, what is prefilled, the tokens chosen so far, its sampling,
its KV bookkeeping, whether a step of it is in flight, its speculation).

A stream whose KV went with a broken pipeline restarts (`restart`): on a new lease it prefills
its prompt and every token generated so far, then samples the token after them, so nothing it
emitted is emitted again and its (seed, position) draws are the ones it would have made."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

from shardline.config import SamplingParams
from shardline.decoding.masks import Constraint
from shardline.pipeline.hidden import HiddenChunk, PromptHidden
from shardline.pipeline.kv import KvSnapshot
from shardline.pipeline.plan import Lease, StreamId
from shardline.serving.kv_blocks import BlockTable
from shardline.serving.speculation import Speculation
from shardline.stage.cache import KVBook

if TYPE_CHECKING:
    from shardline.serving.engine import Ticket

# Stream ids are unique in the process (engines and instances share them): a stream that moves
# to a decode instance keeps its id there. Taking the next is atomic (one bytecode under the GIL).
_ids = count()
_UNSET = Lease(-(1 << 62))  # no lease given: the stream's id (group leases are small negatives)


def new_stream_id() -> StreamId:
    return StreamId(next(_ids))


@dataclass
class Handover:
    """What disaggregated serving (disagg/) keeps on a stream: the decode tokens predicted for it
    (the low end of a length prediction; 0: none made), for which a decode instance reserves KV;
    what stage 0 saw of its prefix so far on a prefill instance whose pipeline summarizes (the
    length predictor's input); and the slices of its KV already exported, in slot order, by a
    prefill instance that transfers chunk by chunk (the slots [0, kv_through))."""

    expect: int = 0
    hidden: PromptHidden | None = None
    kv_sent: list[Future[KvSnapshot]] = field(default_factory=list)
    kv_through: int = 0

    def saw(self, chunk: HiddenChunk) -> None:
        """Stage 0's summary of one more prompt chunk (a summarizing pipeline's outcome)."""
        self.hidden = self.hidden or PromptHidden(int(chunk.total.shape[0]))
        self.hidden.add(chunk)

    def restart(self) -> None:
        """A replay prefills anew, on a new lease: nothing seen or exported of the old one counts."""
        self.hidden, self.kv_sent, self.kv_through = None, [], 0


@dataclass(eq=False)
class Stream:
    id: StreamId  # for the stream's whole life, replays and moves included: outcomes name it
    prompt: list[int]
    params: SamplingParams  # its seed fixed for the stream's whole life
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    want_logits: bool = False
    owner: Ticket | None = None  # the engine's handle on the request
    # Whose kept prefixes it may start from and whose its own KV joins when it ends (an API
    # key's, serving/prefix.py); None: it neither reuses nor is kept ("cache_prompt": false).
    prefix_scope: str | None = None
    copying: Future[None] | None = None  # a kept prefix on its way into its lease: no step until in
    prompt_kept: bool = False  # its prompt's KV was offered to the prefix cache (once)
    prefix_looked: bool = False  # a kept prefix was looked for (once, as its prefill was about to start)
    prefix_saved: int = 0  # paged: prompt tokens its hit (counted once) saved; taken back if its blocks are lost
    book: KVBook = field(default_factory=KVBook)
    prefilled: int = 0  # tokens of `prefix()` sent to the stages
    chunk: tuple[int, int] | None = None  # its last prompt chunk: (tokens, tokens cached before it)
    paced: bool | None = None  # its prompt is paced (not a short one: pacing.py), fixed by its first chunk
    generated: list[int] = field(default_factory=list)  # chosen so far; the last is fed next
    in_flight: bool = False  # a step of it is between submit and outcome
    constraint: Constraint | None = None  # its grammar's state after `generated` (constrained decoding)
    spec: Speculation | None = None  # its drafter and drafts, when it speculates
    sent: tuple[float, int, int] | None = None  # (when, rows, width) of its decode step in flight
    resumed: int = 0  # generated tokens its prefill feeds after the prompt (since a restart)
    replays: int = 0  # restarts so far
    lost_at: float | None = None  # when the pipeline broke under it, until it ran again
    handover: Handover = field(default_factory=lambda: Handover())  # disaggregated serving's part
    # The lease of its own state on every stage (while it is not a group's row); a replay or a
    # move to another instance takes a new one. Unset at construction: its id.
    key: Lease = _UNSET
    # On a paged pipeline: its KV's blocks (serving/kv_blocks.py), apart from its identity and
    # lease; None until its first prompt chunk is planned (and again after a restart).
    blocks: BlockTable | None = None

    def __post_init__(self) -> None:
        if self.key == _UNSET:
            self.key = Lease(self.id)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt) + self.resumed

    def prefix(self) -> list[int]:
        """What its prefill feeds: the prompt, and after a restart the tokens generated before."""
        return self.prompt + self.generated[: self.resumed]

    def restart(self, key: Lease, book: KVBook | None = None) -> None:
        """Start again on the lease `key` (a fresh request on every stage) from an empty cache:
        prefill the prompt and the tokens generated so far (the last of them too, which a
        decode step would have fed next: the prefill's last chunk samples what follows it)."""
        if self.in_flight:
            raise ValueError(f"stream {self.id} still has a step in flight")
        self.key, self.book, self.prefilled, self.sent, self.paced = key, book or KVBook(), 0, None, None
        self.handover.restart()
        self.resumed = len(self.generated)
        self.replays += 1
        if self.spec is not None:
            self.spec.restart()

    @property
    def decoding(self) -> bool:
        """Ready for a decode step once nothing of it is in flight: it has a token to feed."""
        return not self.prefilling and bool(self.generated)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens

    def feed(self, drafts: Sequence[int] = ()) -> list[int]:
        """What its next decode step feeds: its last token, then the drafts offered after it."""
        return [self.generated[-1], *drafts]

    def idle_decoder(self) -> bool:
        return self.decoding and not self.in_flight and not self.done
