"""Bad or unsupported model files through the real command line: one clear error line naming
the problem, exit 1, and nothing left that looks like an export (issue 21 point 7)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shardline.cli import main
from tests.cli.test_bad_input import _fails, _no_export_left
from tests.gguf_vocab import byte_level_vocab
from tests.ggufs import FileSpec, write

SMALL = FileSpec(name="bad", weights="Q4_0", layers=1)


def _export(capsys: pytest.CaptureFixture[str], model: Path, message: str, *extra: str) -> None:
    out = model.parent / "out"
    _fails(capsys, ["export", "--model", str(model), "--stages", "1", "--out", str(out), *extra], message)
    _no_export_left(model.parent)


def _cut(path: Path, keep: int) -> Path:
    data = path.read_bytes()
    cut = path.with_name("cut.gguf")
    cut.write_bytes(data[:keep])
    path.unlink()
    return cut


def test_truncated_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(capsys, _cut(write(SMALL, tmp_path / "m.gguf"), 300), "cannot read GGUF file")


def test_truncated_tensor_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(SMALL, tmp_path / "m.gguf")
    _export(capsys, _cut(path, path.stat().st_size - 1000), "cut.gguf")


@pytest.mark.parametrize("keys,message", [
    ({"{arch}.attention.head_count_kv": 3}, "4 heads are not a multiple of 3 KV heads"),
    ({"{arch}.feed_forward_length": 384}, "tensor blk.0.ffn_gate.weight has shape [512, 256], expected [384, 256]"),
    ({"{arch}.embedding_length": 128}, "tensor token_embd.weight has shape [559, 256], expected [559, 128]"),
    ({"{arch}.block_count": 2}, "tensor blk.1.attn_norm.weight is missing"),
    ({"{arch}.block_count": "two"}, "metadata llama.block_count is not a number: 'two'"),
    ({"{arch}.vocab_size": 1000}, "llama.vocab_size says 1000 but the vocabulary has 559 tokens"),
    ({"{arch}.expert_count": 8}, "m.gguf: metadata llama.expert_used_count is missing"),  # Mixtral-style
    ({"{arch}.rope.scaling.type": "yarn"}, "rope scaling 'yarn' is not supported"),
])
def test_inconsistent_or_unsupported_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              keys: dict[str, object], message: str) -> None:
    _export(capsys, write(SMALL.with_(extra_keys=keys), tmp_path / "m.gguf"), message)


@pytest.mark.parametrize("change,message", [
    ({"pre": "jais"}, "unsupported tokenizer.ggml.pre 'jais': supported are "),
    ({"model": "bert"}, "unsupported tokenizer.ggml.model 'bert': supported are "),
])
def test_a_tokenizer_llama_cpp_would_read_otherwise_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               change: dict[str, str], message: str) -> None:
    _export(capsys, write(SMALL.with_(vocab=replace(byte_level_vocab(), **change)), tmp_path / "m.gguf"), message)


def test_vocabulary_that_does_not_match_the_embedding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = SMALL.with_(vocab_rows=byte_level_vocab().size + 5)
    _export(capsys, write(spec, tmp_path / "m.gguf"),
            "the vocabulary has 559 tokens but token_embd.weight has 564 rows")


def test_unsupported_architecture_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(capsys, write(SMALL.with_(arch="gemma2"), tmp_path / "m.gguf"),
            "unsupported architecture 'gemma2' in m.gguf; supported: GGUF architectures gemma3, gpt-oss, llama, "
            "mistral3, qwen2, qwen3, qwen3moe, smollm3")


@pytest.mark.parametrize("arch, missing", [
    ("gemma4", "per-layer token embeddings"),
    ("gemma3n", "AltUp and LAuReL blocks"),
    ("qwen35", "linear-attention layers (Gated DeltaNet"),
    ("qwen2moe", "mixture-of-experts layers"),
    ("deepseek2", "multi-head latent attention (MLA"),
    ("glm4moe", "sigmoid routing"),
    ("llama4", "shared experts"),
])
def test_an_architecture_refused_by_name_says_what_it_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           arch: str, missing: str) -> None:
    from shardline.model.families.refused import REFUSED

    assert missing in REFUSED[arch]
    _export(capsys, write(SMALL.with_(arch=arch), tmp_path / "m.gguf"),
            f"m.gguf: architecture '{arch}' is not supported: {REFUSED[arch]}")


def test_qwen2_without_its_biases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(capsys, write(SMALL.with_(arch="qwen2"), tmp_path / "m.gguf"),
            "a qwen2 model needs biases on q_proj, k_proj, v_proj")


def test_a_weight_type_gguf_cannot_keep_is_named_with_the_way_out(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = write(SMALL.with_(mix={"*": "Q4_0", "ffn_up": "IQ4_NL"}), tmp_path / "m.gguf")
    _export(capsys, path, "tensor blk.0.ffn_up.weight is IQ4_NL, which --weights gguf cannot keep")
    assert main(["export", "--model", str(path), "--stages", "1", "--weights", "fp16", "--no-isolate",
                 "--out", str(tmp_path / "fp16")]) == 0  # the way out the message names
    assert "m.gguf stores tensors as IQ4_NL (1), Q4_0 (8): dequantizing them to f32 and storing them as f16" \
        in capsys.readouterr().err


def test_a_context_larger_than_the_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(capsys, write(SMALL, tmp_path / "m.gguf"), "--context 5000: the model's context is 4096 tokens",
            "--context", "5000")


def test_split_parts_missing_out_of_order_or_inconsistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = write(SMALL, tmp_path / "s.gguf", split_tensors=4)
    parts = sorted(tmp_path.glob("s-0000*-of-*.gguf"))
    assert first == parts[0] and len(parts) == 3  # 12 tensors, 4 per part
    _export(capsys, parts[1], "s-00002-of-00003.gguf is part 2 of 3 of a split model: give its first part")
    parts[2].rename(tmp_path / "aside.gguf")
    _export(capsys, first, "GGUF part s-00003-of-00003.gguf is missing")
    parts[1].rename(parts[2])  # part 2's file where part 3 should be
    _export(capsys, first, "s-00002-of-00003.gguf is missing")
    (tmp_path / "aside.gguf").rename(parts[1])  # part 3's file where part 2 should be
    _export(capsys, first, "s-00002-of-00003.gguf: its split metadata says part 2 of 3, expected 1 of 3")


def test_an_f32_file_is_kept_as_f32_and_recorded(tmp_path: Path) -> None:
    """Not an error: an F32 file under gguf is kept as f32, and the manifest says so."""
    from shardline.model.manifest import load_manifest

    path = write(SMALL.with_(weights="F32"), tmp_path / "m.gguf")
    assert main(["export", "--model", str(path), "--stages", "1", "--no-isolate", "--out", str(tmp_path / "o")]) == 0
    (stage,) = load_manifest(tmp_path / "o").stages
    assert stage.weights_kept == {"F32": 9} and np.isclose(sum(stage.weights_bytes.values()), 4 * sum(
        r * c for r, c in [(559, 256), (256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256),
                           (256, 512), (559, 256)]))
