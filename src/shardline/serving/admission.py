"""Pure decisions over the engine's state: how many streams fit, and whom to admit next."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.context import kv_bytes_per_token
from shardline.serving.kv_blocks import blocks_for


def per_stream_bytes(arch: Arch, stages: int, local_layers: int, context: int, kv: str = "f32", extra_slots: int = 0,
                     draft: Arch | None = None, overhead: int = 0, draft_extra_slots: int = 0) -> int:
    """What one stream may hold on this node: the KV of its layers here (at precision `kv`) at
    `context` tokens plus `extra_slots` (speculation: up to the compaction threshold of masked
    slots and a step's drafts), `overhead` per stage, and its draft model's own KV at the same
    context plus `draft_extra_slots` (its masked slots and its chain of drafts) and overhead, if any."""
    slots = context + extra_slots
    total = kv_bytes_per_token(local_layers, arch.n_kv_heads, arch.head_dim, kv) * slots + overhead * stages
    if draft is not None:
        draft_slots = context + draft_extra_slots
        total += kv_bytes_per_token(draft.n_layers, draft.n_kv_heads, draft.head_dim, kv) * draft_slots + overhead
    return total


def max_streams_for_memory(budget_bytes: int, per_stream_bytes: int, cap: int) -> int:
    """How many streams fit a memory budget when each may grow to `per_stream_bytes`.
    `per_stream_bytes` is a stream's measured fixed cost plus its KV at the longest context."""
    if per_stream_bytes <= 0 or cap < 1:
        raise ShardlineError("per-stream memory and the stream cap must be positive")
    fits = budget_bytes // per_stream_bytes
    if fits < 1:
        raise ShardlineError(f"one stream needs {per_stream_bytes / 2**20:.0f} MiB; "
                             f"the budget is {budget_bytes / 2**20:.0f} MiB")
    return int(min(fits, cap))


def paged_prefills(max_prefills: int, blocks: int, block_size: int, context: int, block_bytes: int) -> tuple[int, str]:
    """The prompts a paged pool of `blocks` lets prefill at once: at most as many as it holds
    streams at the context (a long prompt may need a whole context's blocks: prompts that
    split a pool they cannot all finish wait, or start over, issue 54), and why, when that is
    fewer than `max_prefills` ("" otherwise). `block_bytes`: a block over every stage."""
    per = blocks_for(context, block_size)
    fit = max(1, blocks // per)  # the pool holds one stream at the context (paged_local.pool_blocks)
    if max_prefills <= fit:
        return max_prefills, ""
    have, want = blocks * block_bytes / 2**20, -(-max_prefills * per * block_bytes // 2**20)
    return fit, (f"--max-prefills {max_prefills} lowered to {fit}: the KV pool ({have:.0f} MiB, --kv-cache-mb) of "
                 f"{blocks} blocks of {block_size} tokens holds {fit} stream(s) at --context {context} ({per} blocks "
                 f"each); --kv-cache-mb {want} holds {max_prefills}, or give a smaller --context")


@dataclass(frozen=True)
class Limits:
    max_streams: int  # streams with KV state at once
    max_queue: int  # requests waiting for a stream; beyond this, new requests are turned away

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_queue < 0:
            raise ShardlineError("--max-streams must be >= 1 and --max-queue >= 0")


def to_admit(waiting: int, active: int, limits: Limits) -> int:
    """Requests to start now, oldest first: every free stream slot is filled at once, so a
    request that arrives while others run joins without waiting for them to finish."""
    return max(0, min(waiting, limits.max_streams - active))


def accepts(waiting: int, active: int, limits: Limits) -> bool:
    """Whether a new request may enter (start now or wait in the bounded queue)."""
    return waiting + 1 <= limits.max_queue + max(0, limits.max_streams - active)
