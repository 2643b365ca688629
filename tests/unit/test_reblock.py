"""`export --reblock G` (export/reblock.py): a GGUF's blocks re-quantized into groups of G, round
to nearest over each group's range. Pure: every value is within half a step of the file's, the
codes and zero points fit their width, and a group of zeros stays zeros."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.config import ExportConfig
from shardline.errors import ShardlineError
from shardline.export.reblock import reblock
from shardline.model.quant import GroupQuant, pack_codes


def q4k_like(rows: int, cols: int, seed: int = 0) -> GroupQuant:
    """A K-quant-shaped matrix: u4 codes, 6-bit sub-block scales and mins under f16 super ones."""
    rng = np.random.default_rng(seed)
    groups = cols // 32
    return GroupQuant(kind="Q4_K", packed=pack_codes(rng.integers(0, 16, (rows, cols)), 4), rows=rows, groups=groups,
                      group=32, bits=4, signed=False, zero=0,
                      group_scale=rng.integers(0, 64, (rows, groups)).astype(np.uint8),
                      super_scale=rng.uniform(1e-4, 1e-3, (rows, groups // 8)).astype(np.float16),
                      group_min=rng.integers(0, 64, (rows, groups)).astype(np.uint8),
                      super_min=rng.uniform(1e-4, 1e-3, (rows, groups // 8)).astype(np.float16), min_sign=-1)


def q6k_like(rows: int, cols: int, seed: int = 1) -> GroupQuant:
    rng = np.random.default_rng(seed)
    groups = cols // 16
    return GroupQuant(kind="Q6_K", packed=rng.integers(0, 64, (rows, cols)).astype(np.uint8), rows=rows,
                      groups=groups, group=16, bits=8, signed=False, zero=32,
                      group_scale=rng.integers(-128, 128, (rows, groups)).astype(np.int8),
                      super_scale=rng.uniform(1e-4, 1e-3, (rows, groups // 16)).astype(np.float16))


@pytest.mark.parametrize("make,bits", [(q4k_like, 4), (q6k_like, 8)])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_every_value_is_within_half_a_step_of_the_files(make, bits: int, group: int) -> None:  # type: ignore[no-untyped-def]
    q = make(300, 512)  # 300 rows: more than one chunk of rows, and a partial one
    r = reblock(q, group)
    assert (r.bits, r.group, r.groups, r.rows) == (bits, group, 512 // group, 300)
    assert r.kind == f"{q.kind}>u{bits}g{group}"
    assert r.zero.max() < 2 ** bits and r.scale.dtype == np.float16
    w, back = q.dequantize().reshape(300, -1, group), r.dequantize().reshape(300, -1, group)
    step = r.scale.astype(np.float32)[..., None]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6 * np.abs(w).max())


def test_a_group_of_zeros_comes_back_exactly_and_a_constant_one_within_half_a_step() -> None:
    q = q4k_like(2, 256)
    codes = np.zeros((2, 256), np.uint8)  # every code 0: each value is its group's -min
    q = GroupQuant(**{**q.__dict__, "packed": pack_codes(codes, 4)})
    q.group_min[:] = q.group_min[:, :1]
    q.super_min[:] = q.super_min[:, :1]  # row 0: one value throughout
    q.group_min[1] = 0  # row 1: all zeros
    r = reblock(q, 128)
    w = q.dequantize()
    assert np.all(r.dequantize()[1] == 0) and np.all(w[0] == w[0, 0]) and w[0, 0] < 0
    assert np.all(np.abs(r.dequantize()[0] - w[0]) <= r.scale[0].astype(np.float32).max() / 2)


def test_a_group_that_does_not_divide_the_columns_is_refused() -> None:
    with pytest.raises(ShardlineError, match="cannot be re-blocked into groups of 96"):
        reblock(q4k_like(4, 256), 96)


@pytest.mark.parametrize("group,why", [(0, "multiple of 16"), (-128, "multiple of 16"), (100, "multiple of 16"),
                                       (1 << 20, "multiple of 16")])
def test_bad_reblock_flags_are_clear_errors(group: int, why: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ShardlineError, match=why):
        ExportConfig(out=tmp_path / "x", stages=1, reblock=group)


def test_reblock_needs_the_files_own_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ShardlineError, match="needs --weights gguf, not int8"):
        ExportConfig(out=tmp_path / "x", stages=1, weights="int8", reblock=128)
