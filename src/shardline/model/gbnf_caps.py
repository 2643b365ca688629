"""A client's GBNF grammar (completions' `grammar`) checked before compiling (issue 54), read
with llguidance's own GBNF parser (the one that turns it into Lark for the engine):

- at most 1,000 alternatives in all (20,000 compiled, then failed on the first token: the
  parser's rows hold at most 2,000 items);
- at most 10,000 terminals once counted repetitions are expanded, through rule references too
  (`"a"{1000000}` compiled, then failed on the first token);
- `root` can end: some finite text derives from it (`root ::= x`, `x ::= x "a"` allows nothing).

A grammar in Lark syntax (which the field also takes) is checked by its text only: its
alternatives and repetition counts. Text the parser cannot read is left to the engine, which
says what is wrong with it."""

from __future__ import annotations

import re
from typing import Any

from shardline.model.regex_size import CEILING, regex_size
from shardline.model.schema_caps import MAX_ALTERNATIVES, MAX_REPEAT, CapError

MAX_PASSES = 64  # fixpoint passes over the rules; a longer chain is left to the engine
# What is not syntax in GBNF: strings, character classes, comments (a `|` in them is no alternative).
_NOT_SYNTAX = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')
_LARK_COUNT = re.compile(r"~\s*(\d{1,9})(?:\s*\.\.\s*(\d{1,9}))?|\{(\d{1,9})(?:,(\d{0,9}))?\}")


def check_grammar(text: str) -> None:
    """Raise CapError if the grammar `text` is over a cap or its `root` cannot end."""
    from llguidance.gbnf_to_lark import GrammarParser, is_lark_syntax

    if is_lark_syntax(text):
        return _lark(text)
    if (bars := _NOT_SYNTAX.sub("", text).count("|")) >= MAX_ALTERNATIVES:  # before the parser (Python, ~70 us a rule)
        raise CapError(f"it has at least {bars + 1} alternatives, over the limit of {MAX_ALTERNATIVES}")
    try:
        rules = GrammarParser().parse(text)
    except RecursionError:
        raise CapError("it is nested too deeply") from None
    except Exception:
        return  # not readable: the engine's error names the problem
    try:
        _checked(rules)
    except RecursionError:  # a chain of rules longer than the stack: no grammar a person writes
        raise CapError("its rules refer to each other too deeply") from None


def _checked(rules: dict[str, Any]) -> None:
    from llguidance.gbnf_to_lark import AlternativeNode

    nodes = [n for r in rules.values() for n in _walk(r.alternatives)]
    alternatives = sum(len(n.alternatives) for n in nodes if isinstance(n, AlternativeNode)
                       and len(n.alternatives) > 1)
    if alternatives > MAX_ALTERNATIVES:
        raise CapError(f"it has {alternatives} alternatives, over the limit of {MAX_ALTERNATIVES}")
    if "root" in rules and (size := _Sizes(rules).of("root")) > MAX_REPEAT:
        raise CapError(f"`root` spells out {min(size, 10**9):,} terminals once its counted repetitions are "
                       f"expanded, over the limit of {MAX_REPEAT:,}")
    if "root" in rules and not _ends(rules):
        raise CapError("`root` can never end: every way through it needs a rule that never ends, so no "
                       "output completes it")


def _walk(node: Any) -> list[Any]:
    """Every node under `node`, itself included (no recursion)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children())
    return out


class _Sizes:
    """Terminals each rule spells out with its counts expanded (a rule within itself counts 1)."""

    def __init__(self, rules: dict[str, Any]) -> None:
        self.rules, self.known, self.open = rules, dict[str, int](), set[str]()

    def of(self, name: str) -> int:
        if name in self.known:
            return self.known[name]
        if name in self.open or name not in self.rules:
            return 1
        self.open.add(name)
        self.known[name] = size = self.node(self.rules[name].alternatives)
        self.open.discard(name)
        return size

    def node(self, n: Any) -> int:
        from llguidance.gbnf_to_lark import RegexNode, RepetitionNode, RuleRefNode

        if isinstance(n, RuleRefNode):
            return self.of(n.name)
        if isinstance(n, RegexNode):
            return regex_size(n.rx)
        if isinstance(n, RepetitionNode):
            times = n.max_times if n.max_times is not None else max(n.min_times, 1)
            return min(self.node(n.node) * times, CEILING)
        return min(sum(self.node(c) for c in n.children()), CEILING) if n.children() else 1


def _ends(rules: dict[str, Any]) -> bool:
    """Whether some finite text derives from `root` (least fixpoint over the rules); True when it
    does not settle within MAX_PASSES."""
    known = dict.fromkeys(rules, False)
    for _ in range(MAX_PASSES):
        grown = [name for name, r in rules.items() if not known[name] and _can(r.alternatives, known)]
        known.update(dict.fromkeys(grown, True))
        if known["root"] or not grown:
            return known["root"]
    return True


def _can(n: Any, known: dict[str, bool]) -> bool:
    from llguidance.gbnf_to_lark import AlternativeNode, RepetitionNode, RuleRefNode, SequenceNode

    if isinstance(n, RuleRefNode):
        return known.get(n.name, True)  # an unknown rule is the engine's error to report
    if isinstance(n, RepetitionNode):
        return n.min_times == 0 or _can(n.node, known)
    if isinstance(n, SequenceNode):
        return all(_can(c, known) for c in n.nodes)
    if isinstance(n, AlternativeNode):
        return any(_can(c, known) for c in n.alternatives)
    return True  # a literal, a class


def _lark(text: str) -> None:
    alternatives = text.count("|")  # from above: a `|` in a string counts too
    if alternatives > MAX_ALTERNATIVES:
        raise CapError(f"it has up to {alternatives} alternatives, over the limit of {MAX_ALTERNATIVES}")
    for m in _LARK_COUNT.finditer(text):
        if max(int(g) for g in m.groups() if g) > MAX_REPEAT:
            raise CapError(f"a repetition count of {m.group(0)[:20]!r} is over the limit of {MAX_REPEAT:,}")
