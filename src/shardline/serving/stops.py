"""Stop sequences over streamed text (pure).

Text that could still become a stop sequence is held back, so a client never sees the start of
a stop sequence that then completes; the stop sequence itself is never sent. The engine checks
them where it checks stop tokens (`StopText`, per request), so a stop sequence ends the stream
on the engine thread, with finish "stop", in the same step as the token that completed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    """Text deltas of tokens as they come (model/tokenizer.StreamDecoder)."""

    def push(self, token: int) -> str: ...


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Text safe to send now. After a stop sequence appears, `stopped` is set and the text
        before it is the last thing returned."""
        if self.stopped:
            return ""
        text = self._held + delta
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation, the held-back text was not a stop after all."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop sequence."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class StopText:
    """A request's text as its client may see it: each token detokenized, stop sequences held
    back and cut. `offset` is where a token's text starts among the characters decoded (text
    held back travels later; tokens wholly inside a cut stop sequence start at or past what
    was shown)."""

    def __init__(self, decoder: Detokenizer, stops: Sequence[str]) -> None:
        self._decoder, self._matcher = decoder, StopMatcher(list(stops))
        self.decoded = self.shown = 0  # characters out of the detokenizer, and let through

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def push(self, token: int) -> tuple[str, int]:
        """The text that may be shown after `token`, and where `token`'s own text starts."""
        new, offset = self._decoder.push(token), self.decoded
        self.decoded += len(new)
        delta = self._matcher.push(new)
        self.shown += len(delta)
        return delta, offset

    def flush(self) -> str:
        """At the end of generation: the held-back text was not a stop after all."""
        rest = self._matcher.flush()
        self.shown += len(rest)
        return rest
