"""Prompt lookup: draft tokens without a model, from n-gram matches in the text so far.

The last n tokens of a stream (its prompt and what it has generated) often occur earlier in it:
code repeats names, a rewrite copies its source, a list repeats its pattern. Where they do, the
tokens that followed that earlier occurrence are a cheap guess at what comes next. The longest
suffix that matches wins (n from `max_ngram` down to `min_ngram`), its latest occurrence first.

An index of every n-gram's latest end position is kept up to date as tokens are appended, so
a proposal costs O(max_ngram) whatever the length of the text.
"""

from __future__ import annotations

from collections.abc import Iterable


class PromptLookup:
    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tokens: list[int] = []
        # (n-gram) -> the index just past its latest occurrence whose continuation is known,
        # i.e. where the tokens that followed it start. Updated one step late, so the suffix
        # itself never matches its own position.
        self._latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens accepted into the stream (never drafts that were rejected)."""
        for t in tokens:
            self._index_suffixes()
            self._tokens.append(int(t))

    def _index_suffixes(self) -> None:
        """Record every n-gram that ends at the current end: the next token appended follows it."""
        end = len(self._tokens)
        for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
            self._latest[tuple(self._tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix."""
        end = len(self._tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(self._tokens[end - n : end]))
            if start is not None:
                return self._tokens[start : min(start + k, end)]
        return []
