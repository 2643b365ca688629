"""Where a request goes and when it runs: TetriInfer's two-level scheduling, as pure functions.

- The global scheduler sends each new request to the least-loaded prefill instance, counting
  what a prefix kept there would save of its prompt (prefix reuse: not in TetriInfer).
- A prefill instance's local scheduler orders its queued requests (FCFS, SJF or LJF) over a
  window of PrefillSchedBatch requests, non-preemptively, and prefills each in fixed-size chunks.
- Its dispatcher then picks the decode instance for the prefilled request from the decode loads
  the cluster monitor broadcast: power of two choices among the instances with room.

The decode side (admission, role flips) is in instance.py. Every tie is broken by a stated key,
so a decision depends only on its inputs (and on the given `random.Random` for the dispatcher).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from shardline.disagg.state import ClusterState, DecodeLoad, LengthRange
from shardline.errors import ShardlineError

DEFAULT_PREFILL_BATCH = 16  # TetriInfer's PrefillSchedBatch: the window a local policy reorders


def least_loaded_prefill(state: ClusterState, covered: Mapping[str, int] | None = None) -> str:
    """The prefill instance a new request goes to: the least prompt work there with it, which
    is its queued prompt tokens (the work ahead of it) less the tokens of this prompt a kept
    prefix there would save (`covered`, by instance; none: 0), then the fewest queued
    requests, then the first name. So a chat's next turn goes where its earlier turns are kept,
    unless the work queued there outweighs what that saves."""
    prefills = state.prefill()
    if not prefills:
        raise ShardlineError("no prefill instance in the cluster state: nowhere to send the request")
    saved = covered or {}
    return min(prefills, key=lambda n: (prefills[n].queued_tokens - saved.get(n, 0), prefills[n].queued, n))


class PrefillPolicy(Enum):
    FCFS = "fcfs"  # first come, first served
    SJF = "sjf"  # shortest prompt first
    LJF = "ljf"  # longest prompt first


@dataclass(frozen=True)
class Queued:
    """A request in a prefill instance's queue."""

    id: int
    arrival: int  # its place in arrival order (smaller came first)
    prompt_tokens: int
    started: bool = False  # some of its chunks have run: it keeps its place (non-preemptive)

    def __post_init__(self) -> None:
        if self.arrival < 0 or self.prompt_tokens < 1:
            raise ShardlineError(f"request {self.id}: arrival must be >= 0 and prompt tokens >= 1, "
                                 f"got {self.arrival} and {self.prompt_tokens}")


_ORDER: dict[PrefillPolicy, Callable[[Queued], tuple[int, ...]]] = {
    PrefillPolicy.FCFS: lambda q: (q.arrival, q.id),
    PrefillPolicy.SJF: lambda q: (q.prompt_tokens, q.arrival, q.id),
    PrefillPolicy.LJF: lambda q: (-q.prompt_tokens, q.arrival, q.id),
}


def next_batch(queue: Sequence[Queued], policy: PrefillPolicy,
               batch_size: int = DEFAULT_PREFILL_BATCH) -> list[Queued]:
    """The next batch to prefill, in run order. Requests already started come first, in arrival
    order: no policy displaces them. The rest of the batch is the oldest requests not started
    (up to `batch_size` in all), ordered by `policy`, ties by arrival. The caller runs the batch
    to its end before asking again, as TetriInfer does: a short prompt arriving meanwhile waits."""
    if batch_size < 1:
        raise ShardlineError(f"the prefill batch size must be >= 1, got {batch_size}")
    if len({q.id for q in queue}) != len(queue):
        raise ShardlineError("the prefill queue holds a request id twice")
    by_arrival = sorted(queue, key=_ORDER[PrefillPolicy.FCFS])
    started = [q for q in by_arrival if q.started]
    window = [q for q in by_arrival if not q.started][: max(0, batch_size - len(started))]
    return started + sorted(window, key=_ORDER[policy])


def chunks(prompt_tokens: int, chunk: int) -> list[int]:
    """The prompt tokens each prefill step holds: `chunk` each, the rest in the last. Every
    step is `chunk` positions wide (the size where the device saturates, so a step costs the
    same whatever it holds): the last one's `chunk - rest` positions are padding, masked out,
    written to no cache and never sampled. They cost time and change no token."""
    if prompt_tokens < 1 or chunk < 1:
        raise ShardlineError(f"chunks need prompt tokens >= 1 and a chunk >= 1, got {prompt_tokens} and {chunk}")
    full, rest = divmod(prompt_tokens, chunk)
    return [chunk] * full + ([rest] if rest else [])


def is_heavy(predicted: LengthRange, heavy_from: int) -> bool:
    """A decode predicted to be long: its range starts at `heavy_from` tokens or later."""
    if heavy_from < 1:
        raise ShardlineError(f"the heavy-decode threshold must be >= 1 token, got {heavy_from}")
    return predicted.lo >= heavy_from


def has_room(load: DecodeLoad, prompt_tokens: int, predicted: LengthRange) -> bool:
    """The request's predicted use (its prompt's KV plus the low end of its decode) fits the
    instance's free KV slots."""
    return load.free >= prompt_tokens + predicted.lo


def heavy_light_ratio(heavy: int, light: int) -> float:
    """heavy / light streams. With no light stream: 0 for an empty instance (the best mix), and
    infinite when every stream is heavy (the worst), as heavy / (light + epsilon) tends to."""
    if light:
        return heavy / light
    return math.inf if heavy else 0.0


def dispatch(state: ClusterState, prompt_tokens: int, predicted: LengthRange, rng: random.Random,
             heavy_from: int) -> str:
    """The decode instance for a prefilled request. Among the instances with room, two at
    random (power of two choices: no herd on the one that looked best a period ago), the one
    whose heavy:light ratio would be lower with the request joined; ties go to fewer heavy
    streams, fewer KV slots used, then the name. With room nowhere, the least-used instance:
    the request waits there (the decode instance's admission decides when it starts)."""
    if prompt_tokens < 1:
        raise ShardlineError(f"a request to dispatch needs prompt tokens >= 1, got {prompt_tokens}")
    decodes = state.decode()
    if not decodes:
        raise ShardlineError("no decode instance in the cluster state: nowhere to dispatch the request")
    heavy = int(is_heavy(predicted, heavy_from))
    room = sorted(n for n, x in decodes.items() if has_room(x, prompt_tokens, predicted))
    if not room:
        return min(decodes, key=lambda n: (decodes[n].used / decodes[n].total, -decodes[n].free, n))
    pair = rng.sample(room, 2) if len(room) > 1 else room

    def mix(n: str) -> tuple[float, int, int, str]:
        x = decodes[n]
        return heavy_light_ratio(x.heavy + heavy, x.light + 1 - heavy), x.heavy, x.used, n

    return min(pair, key=mix)
