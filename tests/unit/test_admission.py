"""Admission and capacity decisions: pure functions over the engine's counts."""

from __future__ import annotations

import pytest

from shardline.config import ServeConfig
from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.context import default_context, kv_bytes_per_token, run_context
from shardline.pipeline.paged_local import pool_blocks
from shardline.server import decode_groups
from shardline.serving.admission import (
    Limits,
    accepts,
    max_streams_for_memory,
    paged_prefills,
    per_stream_bytes,
    to_admit,
)

SMOLLM2 = Arch(family="llama", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, intermediate=1536,
               vocab=49152, rope_theta=1e5, rms_eps=1e-5, tied_embeddings=True, max_context=8192)
LLAMA31_8B = Arch(family="llama", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                  intermediate=14336, vocab=128256, rope_theta=5e5, rms_eps=1e-5, tied_embeddings=False,
                  max_context=131072)
LLAMA32_3B = Arch(family="llama", n_layers=28, hidden=3072, n_heads=24, n_kv_heads=8, head_dim=128,
                  intermediate=8192, vocab=128256, rope_theta=5e5, rms_eps=1e-5, tied_embeddings=True,
                  max_context=131072)


def test_kv_bytes_per_token_smollm2() -> None:
    # 30 layers, 3 KV heads of 64, keys and values, f32: 46 080 bytes per token.
    assert kv_bytes_per_token(30, 3, 64) == 46_080
    assert kv_bytes_per_token(30, 3, 64, "f16") == 23_040
    # u8: a code per element and an f32 scale and zero point per token and head
    assert kv_bytes_per_token(15, 3, 64, "u8") == 2 * 15 * 3 * (64 + 8)
    with pytest.raises(ShardlineError, match="KV precision must be one of f32, f16, u8, got 'bf16'"):
        kv_bytes_per_token(1, 1, 64, "bf16")


def test_the_default_context_is_the_models_capped_to_fit_a_16_gib_pc() -> None:
    assert default_context(SMOLLM2) == 8192  # 360 MiB a stream: the whole context
    # Llama 3.1 8B: 256 KiB a token in f32, 32 GiB at 131072; capped at 4 GiB of KV = 16384
    assert kv_bytes_per_token(32, 8, 128) * 131072 == 32 * 2**30
    assert default_context(LLAMA31_8B) == 16384
    assert default_context(LLAMA32_3B) == 18432  # 224 KiB a token: 18724, down to a multiple of 1024
    # a model whose every token is huge still gets 1024 (the budget is a default, not a limit)
    huge = Arch(**(LLAMA31_8B.to_dict() | {"n_layers": 400}))
    assert default_context(huge) == 1024
    tiny = Arch(**(SMOLLM2.to_dict() | {"max_context": 300}))
    assert default_context(tiny) == 300


def test_a_context_asked_for_is_checked_against_the_models() -> None:
    assert run_context(LLAMA31_8B, None) == 16384
    assert run_context(LLAMA31_8B, 131072) == 131072  # more than the default, if asked: the model allows it
    assert run_context(SMOLLM2, 1) == 1
    for bad in (0, -1, 8193):
        with pytest.raises(ShardlineError, match=f"--context {bad}: it must be in 1-8192, the model's"):
            run_context(SMOLLM2, bad)


def test_llama_8b_and_3b_shapes_admit_streams_on_a_24_gib_machine() -> None:
    """The issue's refusal: at 131072 tokens one stream needed 32 GiB (28 GiB for 3B). At the
    default context a 24 GiB machine's half holds several, at f16 twice as many."""
    budget = 12 * 2**30
    for arch in (LLAMA31_8B, LLAMA32_3B):
        context = default_context(arch)
        f32 = max_streams_for_memory(budget, per_stream_bytes(arch, 1, arch.n_layers, context), 64)
        f16 = max_streams_for_memory(budget, per_stream_bytes(arch, 1, arch.n_layers, context, "f16"), 64)
        assert f32 == 3 and f16 == 6
    # a 4-stage split: the coordinator holds 8 of the 32 layers' KV
    assert per_stream_bytes(LLAMA31_8B, 4, 8, 16384) == 2**30
    with pytest.raises(ShardlineError, match="one stream needs 32768 MiB; the budget is 12288 MiB"):
        max_streams_for_memory(budget, per_stream_bytes(LLAMA31_8B, 1, 32, 131072), 64)


def test_max_streams_for_memory() -> None:
    assert max_streams_for_memory(10 * 2**30, 2**30, cap=64) == 10
    assert max_streams_for_memory(10 * 2**30, 2**30, cap=4) == 4
    with pytest.raises(ShardlineError, match="one stream needs 2048 MiB; the budget is 1024 MiB"):
        max_streams_for_memory(2**30, 2 * 2**30, cap=4)


def test_to_admit_fills_free_slots_oldest_first() -> None:
    lim = Limits(max_streams=4, max_queue=8)
    assert to_admit(waiting=0, active=0, limits=lim) == 0
    assert to_admit(waiting=3, active=0, limits=lim) == 3
    assert to_admit(waiting=3, active=2, limits=lim) == 2
    assert to_admit(waiting=3, active=4, limits=lim) == 0


def test_accepts_bounded_queue() -> None:
    lim = Limits(max_streams=2, max_queue=1)
    assert accepts(waiting=0, active=2, limits=lim)
    assert not accepts(waiting=1, active=2, limits=lim)
    assert accepts(waiting=2, active=0, limits=lim)  # two of them are about to start
    assert not accepts(waiting=3, active=0, limits=lim)


def test_limits_validated() -> None:
    with pytest.raises(ShardlineError, match="--max-streams must be >= 1"):
        Limits(max_streams=0, max_queue=1)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("decode_groups", -1, "--decode-groups must be >= 0"),
    ("max_streams", 0, "--max-streams must be >= 1"),
    ("port", 70000, "--port must be in 0-65535, got 70000"),
])
def test_serve_config_refuses_bad_values(field: str, value: int, message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        ServeConfig(**{field: value})  # type: ignore[arg-type]


def test_decode_groups_default_to_one_per_stage_only_with_workers() -> None:
    assert decode_groups(None, 3, remote=True) == 3  # each machine works on its own group
    assert decode_groups(None, 3, remote=False) == 1  # stages sharing cores: one batch
    assert decode_groups(0, 3, remote=True) == 0  # as asked: interleaved


def test_a_speculating_stream_is_budgeted_its_masked_slots_drafts_and_draft_model() -> None:
    arch = SMOLLM2
    draft = arch.truncated(6)
    plain = per_stream_bytes(arch, 2, 30, 8192, overhead=2**20)
    assert plain == 46_080 * 8192 + 2 * 2**20
    spec = per_stream_bytes(arch, 2, 30, 8192, extra_slots=128 + 8 + 1, draft=draft, overhead=2**20,
                            draft_extra_slots=128 + 2 * 17)
    assert spec == 46_080 * (8192 + 137) + 2 * 2**20 + 9_216 * (8192 + 162) + 2**20
    assert per_stream_bytes(arch, 2, 12, 8192) == 18_432 * 8192  # a coordinator holding 12 of the layers
    assert per_stream_bytes(arch, 2, 12, 1024, "f16") == 9_216 * 1024  # a shorter context, a half-size cache


def test_a_paged_pool_lets_no_more_prompts_prefill_than_it_holds_streams_at_the_context() -> None:
    """Issue 54: `serve --kv-cache-mb 92 --context 2048` (65 blocks of 32 tokens, one stream at
    the context needs 64) with two prompts at once split the pool and stalled; --max-prefills is
    lowered at start to the streams the pool holds, saying which flags to change."""
    block = 2 * 30 * 3 * 64 * 4 * 32  # the default model's f32 keys and values, 32 tokens, every layer
    prefills, why = paged_prefills(2, 65, 32, 2048, block)
    assert prefills == 1
    assert why == ("--max-prefills 2 lowered to 1: the KV pool (91 MiB, --kv-cache-mb) of 65 blocks of 32 tokens "
                   "holds 1 stream(s) at --context 2048 (64 blocks each); --kv-cache-mb 180 holds 2, or give a "
                   "smaller --context")
    assert paged_prefills(10, 8 * 64, 32, 2048, block)[0] == 8  # the default pool: 8 streams at the context
    assert paged_prefills(2, 128, 32, 2048, block) == (2, "")
    assert paged_prefills(1, 64, 32, 2048, block) == (1, "")
    with pytest.raises(ShardlineError, match="needs 64 .a larger --kv-cache-mb, or a smaller --context"):
        pool_blocks(block, 32, 2048, 63 * block, None)
    assert pool_blocks(block, 32, 2048, 92 << 20, None) == 65
