"""Stop sequences over streamed text (pure).

Text that could still become a stop sequence is held back, so a client never sees the start of
a stop sequence that then completes; the stop sequence itself is never sent.
"""

from __future__ import annotations


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
