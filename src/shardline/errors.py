"""The one error type the CLI turns into a single clear line and a non-zero exit."""


class ShardlineError(Exception):
    """A user-facing failure: bad input, a corrupt shard, an impossible request."""


class StepRefused(ShardlineError):
    """A step that does not fit the state it names (a stage's KV, a group's rows); nothing ran.
    It fails that step's streams, never the process that refused it."""
