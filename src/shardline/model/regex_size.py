"""Pure: how many characters a regular expression spells out once its counted repetitions are
expanded (issue 54): `^a{1000000}$` is a million, `((a{100}){100}){100}` too. llguidance builds
its lexer from the expanded form, so that size is what a pattern costs to compile (a pattern of a
million took it 1-2 s and then failed on the first token); it is checked before compiling.

An estimate from above, not a parser: every atom (a character, an escape, a class) counts 1, a
group the sum of its alternatives, `{n,m}` multiplies what precedes it by m (by n for `{n,}`),
and `* + ?` leave it as it is (they add no states per count). A text that is not a valid regex
gets a size anyway: the grammar engine then says what is wrong with it."""

from __future__ import annotations

import re

_COUNT = re.compile(r"\{(\d{1,9})(?:(,)(\d{0,9}))?\}[?+]?")  # {n} {n,} {n,m}, lazy or possessive
CEILING = 10**12  # sizes are kept below this: counted repetitions chained cannot grow big integers
_ESCAPE = re.compile(r"\\(?:[pPxu]\{[^}]*\}|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|.)", re.S)


class _Group:
    def __init__(self) -> None:
        self.done = 0  # the alternatives closed so far
        self.seq = 0  # the alternative being read
        self.last = 0  # the last atom's size (what a count multiplies)


def regex_size(pattern: str) -> int:
    """The expanded size of `pattern` (see the module's docstring)."""
    stack, g, i = [], _Group(), 0
    while i < len(pattern):
        c = pattern[i]
        if (m := _COUNT.match(pattern, i)) is not None:
            times = int(m.group(3) or m.group(1)) if m.group(2) else int(m.group(1))
            g.seq = min(g.seq + g.last * (times - 1), CEILING)
            g.last = min(g.last * times, CEILING)
            i = m.end()
            continue
        if c == "(":
            stack.append(g)
            g, i = _Group(), i + 1
            continue
        if c == ")" and stack:
            inner = g.done + g.seq
            g = stack.pop()
            g.seq, g.last, i = min(g.seq + inner, CEILING), inner, i + 1
            continue
        if c == "|":
            g.done, g.seq, g.last, i = min(g.done + g.seq, CEILING), 0, 0, i + 1
            continue
        if c in "*+?^$":
            i += 1
            continue
        i = _class_end(pattern, i) if c == "[" else (m.end() if (m := _ESCAPE.match(pattern, i)) else i + 1)
        g.seq, g.last = g.seq + 1, 1
    while stack:  # unclosed groups: count them as closed
        inner = g.done + g.seq
        g = stack.pop()
        g.seq += inner
    return g.done + g.seq


def _class_end(pattern: str, i: int) -> int:
    """Past the character class opening at `i` (`[]a]` and `[^]a]` hold a `]`; escapes skipped)."""
    j = i + 1
    if pattern[j:j + 1] == "^":
        j += 1
    if pattern[j:j + 1] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
