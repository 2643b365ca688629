"""Pure: the context a run serves, and what a token of KV cache costs at each precision.

A model's own maximum (131072 tokens for Llama 3.1) is rarely what a PC can hold: at f32 one
such stream of Llama 3.1 8B needs 32 GiB of keys and values. So unless `--context` says
otherwise, a run serves the model's maximum capped where one stream's KV over the whole model
takes DEFAULT_KV_BUDGET (4 GiB, a quarter of a 16 GiB PC, which then still holds an 8B
model's ~4.7 GB of 4-bit weights and the runtime), counted at f32 (the exact precision's, and
the same on every node whatever its `--kv-precision`, so a coordinator and its workers agree
on it without being told), rounded down to a multiple of 1024 tokens. The default model
(SmolLM2-135M, 8192 tokens, 45 KiB per token) keeps its full context; Llama 3.1 8B gets 16384.
"""

from __future__ import annotations

from shardline.config import KV_PRECISIONS
from shardline.errors import ShardlineError
from shardline.model.arch import Arch

DEFAULT_KV_BUDGET = 4 << 30
CONTEXT_STEP = 1024


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv: str = "f32") -> int:
    """Keys and values of one token over `n_layers` layers, as the CPU plugin keeps them: u8
    stores an f32 scale and zero point per token and head beside the codes."""
    if kv not in KV_PRECISIONS:
        raise ShardlineError(f"KV precision must be one of {', '.join(KV_PRECISIONS)}, got {kv!r}")
    per_head = {"f32": 4 * head_dim, "f16": 2 * head_dim, "u8": head_dim + 8}[kv]
    return 2 * n_layers * n_kv_heads * per_head


def default_context(arch: Arch) -> int:
    """The model's maximum, capped where one stream's f32 KV over every layer fills the budget."""
    per_token = kv_bytes_per_token(arch.n_layers, arch.n_kv_heads, arch.head_dim)
    fits = DEFAULT_KV_BUDGET // per_token // CONTEXT_STEP * CONTEXT_STEP
    return min(arch.max_context, max(CONTEXT_STEP, fits))


def run_context(arch: Arch, asked: int | None) -> int:
    """The context a run serves: `asked` (`--context`), else the default; never past the model's."""
    if asked is None:
        return default_context(arch)
    if not 1 <= asked <= arch.max_context:
        raise ShardlineError(f"--context {asked}: it must be in 1-{arch.max_context}, the model's (or its "
                             f"export's) context")
    return asked
