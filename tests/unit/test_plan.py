from __future__ import annotations

import pytest

from shardline.errors import ShardlineError
from shardline.export.plan import even_split, parse_layers


def test_even_split_gives_extra_layers_to_first_stages() -> None:
    assert [(p.first, p.last) for p in even_split(30, 4)] == [(0, 7), (8, 15), (16, 22), (23, 29)]
    assert [(p.first, p.last) for p in even_split(30, 1)] == [(0, 29)]
    assert [len(p.layers) for p in even_split(30, 7)] == [5, 5, 4, 4, 4, 4, 4]


def test_ownership_of_embedding_and_head() -> None:
    plans = even_split(30, 3)
    assert [(p.has_embedding, p.has_head) for p in plans] == [(True, False), (False, False), (False, True)]
    (only,) = even_split(30, 1)
    assert only.has_embedding and only.has_head


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ShardlineError, match="cannot split 30 layers into 31 stages"):
        even_split(30, 31)
    with pytest.raises(ShardlineError, match="at least 1"):
        even_split(30, 0)


def test_parse_layers() -> None:
    assert [(p.first, p.last) for p in parse_layers("0-9,10-19,20-29", 30)] == [(0, 9), (10, 19), (20, 29)]
    assert [(p.first, p.last) for p in parse_layers("0-28, 29", 30)] == [(0, 28), (29, 29)]


@pytest.mark.parametrize("spec,message", [
    ("0-9,12-29", "not contiguous"),
    ("0-9,10-20", "covers layers 0-20 but the model has 30"),
    ("0-9,19-10,20-29", "empty layer range '19-10'"),
    ("0-9,x-29", "bad layer range"),
    ("1-29", "expected a range starting at 0"),
])
def test_parse_layers_rejects(spec: str, message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        parse_layers(spec, 30)


def test_run_config_properties() -> None:
    from shardline.config import RunConfig

    assert RunConfig().ov_properties() == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                           "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    assert RunConfig(precision="fast", threads=2).ov_properties() == {"INFERENCE_PRECISION_HINT": "f32",
                                                                      "INFERENCE_NUM_THREADS": "2",
                                                                      "KV_CACHE_PRECISION": "f16"}
    assert RunConfig(precision="fast", device="GPU").ov_properties() == {}
    gpu_f16 = RunConfig(precision="fast", device="GPU", kv_precision="f16")
    assert gpu_f16.ov_properties() == {"KV_CACHE_PRECISION": "f16"}
    assert RunConfig(kv_precision="f16").ov_properties()["KV_CACHE_PRECISION"] == "f16"
    assert RunConfig(precision="plugin").kv is None and RunConfig(precision="plugin", kv_precision="u8").kv == "u8"
    assert RunConfig(precision="rounded").ov_properties() == RunConfig(precision="fast").ov_properties()
    assert RunConfig(precision="plugin").ov_properties() == {}
    assert RunConfig(precision="plugin", threads=1, pinned=False).ov_properties() == {
        "INFERENCE_NUM_THREADS": "1", "ENABLE_CPU_PINNING": "NO"}
    assert RunConfig(precision="plugin", device="GPU", pinned=False).ov_properties() == {}
    with pytest.raises(ShardlineError, match="precision must be one of exact, fast, rounded, plugin"):
        RunConfig(precision="bf16")


@pytest.mark.parametrize("fields,message", [
    ({"context": 0}, "--context must be in 1-16777216 tokens, got 0"),
    ({"context": -8}, "--context must be in 1-16777216 tokens, got -8"),
    ({"context": 1 << 30}, "--context must be in 1-16777216 tokens"),
    ({"kv_precision": "i8"}, "--kv-precision must be one of f32, f16, u8, got 'i8'"),
    ({"kv_precision": "F16"}, "--kv-precision must be one of f32, f16, u8, got 'F16'"),
])
def test_run_config_refuses_contexts_and_kv_precisions_out_of_range(fields: dict[str, object], message: str) -> None:
    from shardline.config import RunConfig

    with pytest.raises(ShardlineError, match=message):
        RunConfig(**fields)  # type: ignore[arg-type]


def test_balanced_split_counts_the_head() -> None:
    from shardline.export.plan import balanced_split

    def ranges(n: int, stages: int, head: float) -> list[tuple[int, int]]:
        return [(p.first, p.last) for p in balanced_split(n, stages, head)]

    # SmolLM2-135M: 30 layers, the head weighs 8.0 layers.
    assert ranges(30, 2, 8.0) == [(0, 18), (19, 29)]
    assert ranges(30, 3, 8.0) == [(0, 12), (13, 24), (25, 29)]  # work 13, 12, 13 layers
    assert ranges(30, 1, 8.0) == [(0, 29)]
    assert ranges(30, 2, 0.0) == [(0, 14), (15, 29)]
    assert ranges(4, 4, 50.0) == [(0, 0), (1, 1), (2, 2), (3, 3)]  # every stage keeps a layer
    assert ranges(3, 2, 100.0) == [(0, 1), (2, 2)]
