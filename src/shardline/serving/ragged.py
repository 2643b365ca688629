"""What one paged step runs (issue 41), pure: every running stream's decode tokens and the prompt
chunks that fit a token budget, packed into one flat batch (Sarathi-Serve's stall-free batching,
vLLM's `max_num_batched_tokens`).

Decode tokens go first and whole (a stream's last token and its drafts): a running stream never
waits for a prompt. Prompts fill what the budget leaves, oldest first, each with as much of its
remaining prompt as fits, so a long prompt is cut into chunks that ride with the decode tokens of
every step instead of stalling them. Decode tokens alone may exceed the budget; then no prompt
runs that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardline.errors import ShardlineError


@dataclass(frozen=True)
class Budget:
    tokens: int  # new tokens a step may carry (prompt chunks fill up to it)

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ShardlineError(f"a step's token budget must be at least 1 token, not {self.tokens}")


@dataclass(frozen=True)
class Want:
    stream: int
    tokens: int  # what the stream would feed now: 1 + drafts decoding, its prompt's rest prefilling
    decoding: bool


def pack(wants: Sequence[Want], budget: Budget) -> list[tuple[int, int]]:
    """(stream, new tokens) of one step, decode entries first, then prompt chunks in the order
    of `wants` (oldest first) while the budget lasts."""
    out = [(w.stream, w.tokens) for w in wants if w.decoding and w.tokens > 0]
    left = budget.tokens - sum(n for _, n in out)
    for w in wants:
        if w.decoding or w.tokens <= 0 or left <= 0:
            continue
        n = min(w.tokens, left)
        out.append((w.stream, n))
        left -= n
    return out
