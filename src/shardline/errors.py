"""The one error type the CLI turns into a single clear line and a non-zero exit."""


class ShardlineError(Exception):
    """A user-facing failure: bad input, a corrupt shard, an impossible request."""
