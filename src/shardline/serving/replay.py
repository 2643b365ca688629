"""Whether a stream the pipeline lost is replayed (pure).

A stream is lost when the pipeline broke under it (a worker died or stopped answering): its KV
on the workers is gone, but its prompt and tokens are here, so it can start again on the
repaired pipeline (Stream.restart). Bounded, so that no request hangs on a pipeline that does
not come back: a few restarts in a stream's life, and each repair within a time limit from the
moment the pipeline broke under it until it runs again.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.errors import ShardlineError


@dataclass(frozen=True)
class Replays:
    most: int = 4  # restarts in a stream's life
    within_s: float = 30.0  # from the pipeline breaking under a stream to its next step's success

    def __post_init__(self) -> None:
        if self.most < 0 or not self.within_s > 0:
            raise ShardlineError(f"replays need a count >= 0 and a time > 0 s, got {self.most} and {self.within_s}")


def refusal(policy: Replays, replays: int, lost_for: float, why: str) -> str | None:
    """Why a stream lost for `lost_for` seconds, after `replays` restarts, is not replayed
    again (None: replay it); `why` is what the pipeline said."""
    if lost_for > policy.within_s:
        return f"the pipeline broke and could not be repaired within {policy.within_s:g} s: {why}"
    if replays >= policy.most:
        return f"the pipeline broke under this request {replays + 1} times; not replayed again: {why}"
    return None
