"""The one error type the CLI turns into a single clear line and a non-zero exit."""


class ShardlineError(Exception):
    """A user-facing failure: bad input, a corrupt shard, an impossible request."""


class StepRefused(ShardlineError):
    """A step that does not fit the state it names (a stage's KV, a group's rows); nothing ran.
    It fails that step's streams, never the process that refused it."""


class Unsampleable(ValueError):
    """No token can be chosen for one sampled entry (its logits, its mask): that entry's stream
    fails alone, never the step it shares with others (decoding/sampler.entry). Its message is
    one of `REASONS`, so that it travels as a code (wire Sampled.failed) and names no one's data."""

    REASONS: tuple[str, ...] = ("the logits are not finite", "its token mask allows no token",
                                "a draft or its support is outside the vocabulary")

    def __init__(self, code: int) -> None:
        super().__init__(self.REASONS[code])
        self.code = code
