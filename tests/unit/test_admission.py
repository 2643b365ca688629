"""Admission and capacity decisions: pure functions over the engine's counts."""

from __future__ import annotations

import pytest

from shardline.config import ServeConfig
from shardline.errors import ShardlineError
from shardline.server import decode_groups
from shardline.serving.admission import Limits, accepts, kv_bytes_per_token, max_streams_for_memory, to_admit


def test_kv_bytes_per_token_smollm2() -> None:
    # 30 layers, 3 KV heads of 64, keys and values, f32: 46 080 bytes per token.
    assert kv_bytes_per_token(30, 3, 64) == 46_080
    assert kv_bytes_per_token(15, 3, 64, dtype_bytes=1) == 5_760


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
    from shardline.model.arch import Arch
    from shardline.serving.admission import per_stream_bytes

    arch = Arch(family="llama", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64,
                intermediate=1536, vocab=49152, rope_theta=1e5, rms_eps=1e-5, tied_embeddings=True, max_context=8192)
    draft = Arch(family="llama", n_layers=6, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64,
                intermediate=1536, vocab=49152, rope_theta=1e5, rms_eps=1e-5, tied_embeddings=True, max_context=8192)
    plain = per_stream_bytes(arch, 2, 30, overhead=2**20)
    assert plain == 46_080 * 8192 + 2 * 2**20
    spec = per_stream_bytes(arch, 2, 30, extra_slots=128 + 8 + 1, draft=draft, overhead=2**20,
                            draft_extra_slots=128 + 2 * 17)
    assert spec == 46_080 * (8192 + 137) + 2 * 2**20 + 9_216 * (8192 + 162) + 2**20
    assert per_stream_bytes(arch, 2, 12) == 18_432 * 8192  # a coordinator holding 12 of the layers
