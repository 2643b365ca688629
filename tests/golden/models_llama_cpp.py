"""Regenerate tests/golden/models.json: llama.cpp's greedy tokens and logits on the dequantized
f32 copy of every hand-built model file in tests/gguf_cases.py.

    .venv/bin/python -m tests.golden.models_llama_cpp      (after `make bench-deps`)

The f32 copy holds exactly the values the quantized file stands for (gguf-py's dequantization),
so this is the model's own answer, free of llama.cpp's 8-bit activation quantization on
quantized weights; shardline's `--weights gguf` export of the quantized file must give it too.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.gguf_cases import CASES, LOGIT_STEPS, STEPS, Case
from tests.ggufs import file_sha256
from tests.golden.llama_cpp import LLAMA_CPP_PYTHON, open_llama

GOLDEN = Path(__file__).with_name("models.json")


def encode_row(row: np.ndarray) -> str:
    return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode()


def decode_row(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], dict[str, str]]:
    llm = open_llama(path, n_ctx=len(prompt) + steps + 8, logits_all=True)
    llm.reset()
    llm.eval(prompt)
    tokens: list[int] = []
    rows: dict[str, str] = {}
    for step in range(steps):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        if step in LOGIT_STEPS:
            rows[str(step)] = encode_row(row)
        tokens.append(int(np.argmax(row)))
        llm.eval([tokens[-1]])
    return tokens, rows


def golden(case: Case, work: Path) -> dict[str, object]:
    path, copy = case.write(work), case.write(work, dequantized=True)
    tokens, rows = greedy(copy, case.prompt(), STEPS)
    return {"sha256": file_sha256(path), "prompt_len": case.prompt_len, "tokens": tokens, "logits": rows}


def main() -> int:
    out: dict[str, object] = {"llama_cpp_python": LLAMA_CPP_PYTHON, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            folder = Path(tmp) / name
            folder.mkdir()
            out["files"][name] = golden(case, folder)  # type: ignore[index]
            print(name, out["files"][name]["tokens"][:8], file=sys.stderr)  # type: ignore[index]
    tmp_file = GOLDEN.with_suffix(".json.partial")
    tmp_file.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp_file, GOLDEN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
