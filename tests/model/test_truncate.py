"""--truncate N: the target's first N layers, then its final norm and head, as an ordinary
one-stage export (a self-speculation draft). Its tokens are those of the reference model cut
the same way, it reads no layer past N, and bad counts are refused with one clear line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from shardline.config import ExportConfig, RunConfig
from shardline.errors import ShardlineError
from shardline.export.exporter import export
from shardline.model.arch import Arch
from shardline.model.gguf_source import GGUFSource
from shardline.model.manifest import load_manifest
from shardline.model.quant import Stored
from shardline.model.source import ModelSource, open_source
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from tests.conftest import CHAT_PROMPTS
from tests.helpers import greedy_ours
from tests.model.reference import greedy_reference, reference_model

KEEP = 4
N_NEW = 8
LOGIT_ATOL = 2e-3  # as tests/model/test_exactness.py: f32 both sides, different summation orders
EXACT = RunConfig(precision="exact")


@dataclass
class Exported:
    folder: Path
    read: set[str]  # every tensor name the export asked the source for


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    read: set[str] = set()
    tensor, stored = GGUFSource.tensor, GGUFSource.stored

    def spy_tensor(self: GGUFSource, name: str) -> np.ndarray:
        read.add(name)
        return tensor(self, name)

    def spy_stored(self: GGUFSource, name: str) -> Stored | None:
        read.add(name)
        return stored(self, name)

    out = tmp_path_factory.mktemp("truncate") / f"first{KEEP}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GGUFSource, "tensor", spy_tensor)
        mp.setattr(GGUFSource, "stored", spy_stored)
        export(ExportConfig(out=out, stages=1, weights="gguf", truncate=KEEP, isolate=False, progress=False))
    return Exported(out, read)


@dataclass
class _Truncated:
    """A source seen through a truncated arch (what the reference is built from)."""

    inner: ModelSource
    arch: Arch

    @property
    def format(self) -> str:
        return self.inner.format

    @property
    def path(self) -> Path:
        return self.inner.path

    def tensor(self, name: str) -> np.ndarray:
        return self.inner.tensor(name)


def test_manifest_says_n_layers_in_one_stage_with_embedding_and_head(truncated: Exported) -> None:
    m = load_manifest(truncated.folder)
    full = open_source(None).arch
    assert m.arch == full.truncated(KEEP) and m.arch.n_layers == KEEP
    (stage,) = m.stages
    assert (stage.first_layer, stage.last_layer, stage.has_embedding, stage.has_head) == (0, KEEP - 1, True, True)
    assert len(stage.state) == 2 * KEEP  # one key and one value cache per kept layer
    assert m.extra["truncated_from"] == full.n_layers
    # another model than the full one: a worker of the full model's export is never chained to it
    assert m.model_hash != m.extra["source_sha256"] and len(m.model_hash) == 64


def test_reads_no_layer_past_n(truncated: Exported) -> None:
    layers = {int(n.split(".")[2]) for n in truncated.read if n.startswith("model.layers.")}
    assert layers == set(range(KEEP))
    assert "model.norm.weight" in truncated.read


def test_logits_are_the_reference_cut_to_n_layers(truncated: Exported) -> None:
    source = open_source(None)
    model = reference_model(_Truncated(source, source.arch.truncated(KEEP)))
    assert model.config.num_hidden_layers == KEEP
    tok = ChatTokenizer(truncated.folder)
    with LocalPipeline(truncated.folder, EXACT) as pipe:
        for text in CHAT_PROMPTS[:2]:
            prompt = tok.encode_chat([{"role": "user", "content": text}])
            ref_tokens, ref_logits = greedy_reference(model, prompt, N_NEW)
            tokens, logits = greedy_ours(pipe, prompt, N_NEW)
            np.testing.assert_allclose(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
            assert tokens == ref_tokens


def test_more_layers_than_the_model_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardlineError, match=r"^--truncate 31: the model has only 30 layers$"):
        export(ExportConfig(out=tmp_path / "out", stages=1, weights="gguf", truncate=31, isolate=False,
                            progress=False))
    assert not any(tmp_path.iterdir())


def test_cli_refuses_truncate_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardline.cli import main

    assert main(["export", "--stages", "1", "--truncate", "0", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["shardline: error: --truncate must be at least 1 (layers kept), got 0"]
    assert not any(tmp_path.iterdir())
