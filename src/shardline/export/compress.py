"""Weight compression through NNCF (int8, int4); fp32/fp16/gguf are decided in weights.py."""

from __future__ import annotations

import contextlib
import logging
import sys

import openvino as ov

from shardline.errors import ShardlineError


def check_group_size(hidden: int, intermediate: int, group_size: int) -> None:
    for dim in (hidden, intermediate):
        if dim % group_size:
            raise ShardlineError(
                f"int4 group size {group_size} does not divide the model's dimension {dim}; try 64 or 32"
            )


def compress(model: ov.Model, weights: str, group_size: int) -> ov.Model:
    if weights not in ("int8", "int4"):
        return model
    import nncf

    logging.getLogger("nncf").setLevel(logging.ERROR)
    # NNCF draws its own progress bar on stdout; stdout belongs to the command's output.
    with contextlib.redirect_stdout(sys.stderr):
        if weights == "int8":
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        # INT4_SYM as the paper; embedding and lm_head stay int8 (NNCF's default backup).
        return nncf.compress_weights(
            model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group_size, ratio=1.0
        )
