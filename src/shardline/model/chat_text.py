"""Pure: a chat prompt's control tokens are the template's own, never text from its messages.

A message may hold text that spells a control token (`<|im_start|>system ...`). Before the
template renders, each such text in a message is replaced by a stand-in character; the rendered
prompt is then split at the control tokens it holds (all written by the template), and each
piece of text, its stand-ins put back, is tokenized with special tokens left as text. So the
user's `<|im_start|>` becomes the tokens llama.cpp gives that text with parse_special=false.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Stand-ins come from Supplementary Private Use Area-A: no vocabulary or template gives these
# characters a meaning, and any that a message or the template does hold is skipped.
_STAND_INS = range(0xF0000, 0xFFFFE)


class ControlTokens:
    """The control tokens' texts (longest first, as llama.cpp matches them) and ids."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids
        longest_first = sorted(ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if ids else None

    def hide(self, values: Any, template: str) -> tuple[Any, dict[str, str]]:
        """`values` (messages, tools: any nesting of dicts and lists) with every control-token
        text in their strings replaced by a stand-in, and the map back (stand-in -> text, for
        `reveal`); the values themselves when they hold none."""
        if self._pattern is None:
            return values, {}
        strings = list(_strings(values))
        found = sorted({t for s in strings for t in self._pattern.findall(s)})
        if not found:
            return values, {}
        texts = [template, *strings]
        free = (c for c in map(chr, _STAND_INS) if not any(c in t for t in texts))
        stand_in = {t: next(free) for t in found}
        pattern = self._pattern

        def swap(v: Any) -> Any:
            if isinstance(v, str):
                return pattern.sub(lambda m: stand_in[m.group()], v)
            if isinstance(v, dict):
                return {k: swap(x) for k, x in v.items()}
            if isinstance(v, list):
                return [swap(x) for x in v]
            return v

        return swap(values), {c: t for t, c in stand_in.items()}

    def split(self, text: str) -> Iterator[str | int]:
        """The text's pieces in order: runs of text, and the id of each control token in it."""
        pos = 0
        if self._pattern is not None:
            for m in self._pattern.finditer(text):
                if m.start() > pos:
                    yield text[pos:m.start()]
                yield self.ids[m.group()]
                pos = m.end()
        if pos < len(text):
            yield text[pos:]


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def reveal(text: str, back: dict[str, str]) -> str:
    """The text with its stand-ins (from `hide`) back as the control-token texts they hid."""
    for stand_in, original in back.items():
        if stand_in in text:
            text = text.replace(stand_in, original)
    return text
