"""Where drafts come from: a stream's drafter proposes the tokens a verify step offers.

- `LookupDrafter`: prompt lookup (decoding/lookup.py), no model: the continuation of the latest
  earlier occurrence of the text's last n-gram.
- `ModelDrafter` (stage/draft_model.py): a small model on the coordinator, its own KV per stream.

Both give a `Proposal` (decoding/drafts.py). This module imports no OpenVINO: the scheduler and
the engine know drafters only through the `Drafter` protocol.
"""

from __future__ import annotations

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.decoding.lookup import PromptLookup

# Prompt lookup offers a draft only where 2-4 tokens of the text recur, and there its drafts
# stood 69% of the time over the 8 prompt types (BENCHMARKS.md, issue 10). With the default
# prior of one in three, auto K hardly ever offered its first draft on a fast link (a draft
# must look likelier than ~40% to pay for its verified position), so the text never got the
# chance to prove it. Its own pace and acceptance take over once it drafts.
LOOKUP_PRIOR = 0.6


class LookupDrafter:
    cost_s = 0.0

    def __init__(self) -> None:
        # A match of one token rarely continues as the text does (measured on chat answers:
        # acceptance fell by half with 1-grams); two to four tokens must match.
        self._index = PromptLookup(max_ngram=4, min_ngram=2)

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        self._index.extend(context[len(self._index):])
        return Proposal(self._index.propose(k))

    def ready(self, context: list[int]) -> int:
        return 0  # the index holds accepted text only: it catches up from the context

    def follow(self, context: list[int], params: SamplingParams, limit: int) -> bool:
        return False  # free to propose: nothing to gain by drawing early

    def close(self) -> None:
        pass


