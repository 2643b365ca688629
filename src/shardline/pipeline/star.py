"""Star (for comparison, as the paper's measured code): every worker's output comes back to the
coordinator, which sends it on to the next; each relay adds a coordinator row (stage RELAY) to
the step's hops. Runs on the caller's thread, one step at a time."""

from __future__ import annotations

import time
from dataclasses import replace

from shardline.errors import ShardlineError
from shardline.wire.hops import with_rows
from shardline.wire.link import Link
from shardline.wire.messages import RELAY, Forward, Ragged, Refuse, Sampled, StepFailed


class StarRefused(ShardlineError):
    """A worker refused the step itself (it does not fit): the step fails, the links go on."""


def relay(links: list[Link], workers: list[str], fwd: Forward | Ragged) -> tuple[Sampled, float]:
    """`fwd` through every worker in turn: the last one's tokens and when their frame was
    decoded. Raises StarRefused for a step refused; anything else raised (LinkClosed, Refused,
    WireError, ShardlineError) means a link is no longer usable."""
    reply: Forward | Ragged | Sampled = fwd
    received_at = time.perf_counter()
    for i, link in enumerate(links):
        if i:
            assert isinstance(reply, Forward | Ragged)
            host_s = time.perf_counter() - received_at
            rows = with_rows(reply.hops, [RELAY], [0.0], links[i - 1].last_decode_s, host_s)
            # the merge was done by the worker before: the next one does its own
            reply = replace(reply, hops=rows)
        link.send(reply, stamp=True)
        reply = _expect(link, workers[i], fwd.seq)
        received_at = time.perf_counter()
    if not isinstance(reply, Sampled):
        raise StarRefused(f"worker {workers[-1]} returned hidden states, not tokens")
    return reply, received_at


def _expect(link: Link, worker: str, seq: int) -> Forward | Ragged | Sampled:
    reply = link.recv()
    if isinstance(reply, StepFailed):
        raise StarRefused(f"worker {worker} refused: {reply.reason}")
    if isinstance(reply, Refuse):
        raise ShardlineError(f"worker {worker} refused: {reply.reason}")
    if not isinstance(reply, Forward | Ragged | Sampled) or reply.seq != seq:
        raise ShardlineError(f"unexpected {type(reply).__name__} from worker {worker}")
    return reply
