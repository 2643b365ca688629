"""Running shards (coordinator, workers, tokenizer) needs only openvino, numpy, tokenizers and
jinja2 (and llguidance for constrained decoding, on the coordinator): torch, transformers, nncf,
gguf and tqdm are export- or test-time only, cryptography keygen-time only (links use the
standard ssl module)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SCRIPT = r"""
import sys
BLOCKED = {"torch", "transformers", "nncf", "gguf", "tqdm", "accelerate", "safetensors", "cryptography"}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"run time imported {name}")
        return None

sys.meta_path.insert(0, Block())
from pathlib import Path
from shardline.config import RunConfig, SamplingConfig, ServeConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.server import open_engine
from shardline.serving.generate import tokens
import shardline.pipeline.remote, shardline.node.worker, shardline.cluster.relay, shardline.cli, shardline.api.app

folder = Path(sys.argv[1])
tok = ChatTokenizer(folder)
prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
engine, _ = open_engine(folder, RunConfig(), ServeConfig(max_streams=1))
print(tok.decode(tokens(engine, prompt, SamplingConfig(max_tokens=8), tok.stop_ids)))
engine.shutdown()
from shardline.model.grammar import Grammars, GrammarSpec  # constrained decoding: llguidance alone
from shardline.model.manifest import load_manifest
grammars = Grammars((folder / "tokenizer.json").read_text(), load_manifest(folder).arch.vocab, tok.stop_ids)
print("mask", grammars.constraint(GrammarSpec.json_schema({"type": "object"})).masks([]).shape)
"""


def test_run_time_path_imports_no_export_dependencies(shards: Callable[..., Path]) -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(shards("fp32", stages=2))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout and "mask (1, 1536)" in run.stdout
