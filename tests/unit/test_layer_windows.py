"""Which layers are local, as llama.cpp lays them out (llama_hparams::set_swa_pattern), and what
each layer's window and rotary are (Arch.window, Arch.rotary); pure, no files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.gguf_meta import _local_layers

GEMMA = Arch(family="gemma3", n_layers=12, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128,
             vocab=300, rope_theta=1e6, rms_eps=1e-6, tied_embeddings=True, max_context=4096, rope_linear=8.0,
             sliding_window=512, local_layers=(0, 1, 2, 3, 4, 6, 7, 8, 9, 10), local_rope_theta=10000.0)


def test_every_nth_layer_is_global() -> None:
    assert _local_layers(None, 6, 12, "f") == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert _local_layers(2, 6, 5, "f") == (0, 2, 4)
    assert _local_layers(0, 6, 3, "f") == (0, 1, 2)  # 0: every layer local
    assert _local_layers(1, 6, 3, "f") == ()  # 1: every layer global


def test_a_pattern_of_one_bool_per_layer() -> None:
    assert _local_layers([True, False, True], 6, 3, "f") == (0, 2)


@pytest.mark.parametrize("pattern, match", [
    ([True, False], "one true/false per layer \\(3\\)"),
    ([1, 0, 1], "one true/false per layer"),
    (-2, "-2 is not a layer pattern"),
    (2.5, "2.5 is not a layer pattern"),
    (True, "True is not a layer pattern"),
])
def test_a_pattern_the_family_does_not_know_is_refused(pattern: object, match: str) -> None:
    with pytest.raises(ShardlineError, match=match):
        _local_layers(pattern, 6, 3, "f")


def test_local_layers_have_their_window_and_rotary_global_ones_the_models() -> None:
    assert [GEMMA.window(i) for i in (0, 5, 6, 11)] == [512, None, 512, None]
    assert GEMMA.rotary(0) == (10000.0, None, False) and GEMMA.rotary(5) == (1e6, 8.0, True)


def test_a_window_as_long_as_the_context_is_full_attention() -> None:
    short = GEMMA.with_context(512)
    assert [short.window(i) for i in range(12)] == [None] * 12
    assert GEMMA.with_context(513).window(0) == 512


def test_a_truncated_model_keeps_its_own_local_layers() -> None:
    assert GEMMA.truncated(6).local_layers == (0, 1, 2, 3, 4)


def test_manifests_round_trip_and_older_ones_read_every_layer_as_local() -> None:
    assert Arch.from_dict(GEMMA.to_dict()) == GEMMA
    old = replace(GEMMA, local_layers=(), local_rope_theta=None, max_context=512).to_dict()
    del old["local_layers"]
    assert Arch.from_dict(old).local_layers == tuple(range(12))


@pytest.mark.parametrize("changes, match", [
    ({"sliding_window": None}, "local \\(sliding-window\\) layers need a sliding window"),
    ({"sliding_window": 0}, "sliding window 0: it must be at least 1 token"),
    ({"local_layers": (0, 12)}, "are not distinct layers of 12"),
    ({"local_layers": (3, 1)}, "are not distinct layers"),
    ({"local_rope_theta": -1.0}, "local rotary base -1.0 must be a positive number"),
    ({"query_scale": 0.0}, "query scale 0.0 must be a positive number"),
])
def test_an_inconsistent_arch_is_refused(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ShardlineError, match=match):
        replace(GEMMA, **changes)  # type: ignore[arg-type]
