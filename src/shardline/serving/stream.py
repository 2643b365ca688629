"""One record per stream: everything the engine and the scheduler know about a request that
holds KV on the stages (its prompt, what is prefilled, the tokens chosen so far, its sampling,
its KV bookkeeping, whether a step of it is in flight, its speculation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardline.config import SamplingParams
from shardline.serving.speculation import Speculation
from shardline.stage.cache import KVBook


@dataclass(eq=False)
class Stream:
    id: int  # also the key of its own request on every stage while it is not a group's row
    prompt: list[int]
    params: SamplingParams  # its seed fixed for the stream's whole life
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    want_logits: bool = False
    owner: Any = None  # the engine's handle on the request (its Ticket)
    book: KVBook = field(default_factory=KVBook)
    prefilled: int = 0  # prompt tokens sent to the stages
    generated: list[int] = field(default_factory=list)  # chosen so far; the last is fed next
    in_flight: bool = False  # a step of it is between submit and outcome
    spec: Speculation | None = None  # its drafter and drafts, when it speculates
    sent: tuple[float, int, int] | None = None  # (when, rows, width) of its decode step in flight

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def decoding(self) -> bool:
        """Ready for a decode step once nothing of it is in flight: it has a token to feed."""
        return not self.prefilling and bool(self.generated)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens

    def feed(self) -> list[int]:
        """What its next decode step feeds: its last token, then the drafts offered after it."""
        return [self.generated[-1], *(self.spec.proposal.tokens if self.spec else [])]

    def idle_decoder(self) -> bool:
        return self.decoding and not self.in_flight and not self.done
