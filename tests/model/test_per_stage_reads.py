"""Exporting one stage reads that stage's tensors and no others."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.export.graph import build_stage, stage_tensor_names
from shardline.export.plan import even_split
from shardline.export.weights import Weights
from shardline.model.gguf_source import GGUFSource
from shardline.model.quant import Blocks, Stored
from shardline.model.source import default_model_path


class SpySource(GGUFSource):
    def __init__(self) -> None:
        super().__init__(default_model_path())
        self.read: list[str] = []

    def tensor(self, name: str) -> np.ndarray:
        self.read.append(name)
        return super().tensor(name)

    def stored(self, name: str) -> Stored | None:
        self.read.append(name)
        return super().stored(name)

    def blocks(self, name: str) -> Blocks | None:
        self.read.append(name)
        return super().blocks(name)


@pytest.mark.parametrize("index", [0, 2, 4])
def test_stage_reads_only_its_own_tensors(index: int) -> None:
    source = SpySource()
    plan = even_split(source.arch.n_layers, 5)[index]
    build_stage(source.arch, plan, Weights(source, "gguf", block_ops=True))
    assert set(source.read) == set(stage_tensor_names(source.arch, plan))
    layers = {int(n.split(".")[2]) for n in source.read if n.startswith("model.layers.")}
    assert layers == set(plan.layers)
    # the embedding is read by stage 0 and, tied, by the last stage; never by a middle stage
    assert ("model.embed_tokens.weight" in source.read) == (plan.has_embedding or plan.has_head)
