"""Regenerate tests/golden/families.json: llama.cpp's answer for the hand-built files of the
families llama-cpp-python's goldens do not cover yet (Qwen3, SmolLM3, Mistral 3, Gemma 3, Qwen3-MoE
with and without router ties, Mixtral, gpt-oss):
greedy tokens and, at the steps LOGIT_STEPS names, the log-probabilities of every token of the
vocabulary, on the dequantized f32 copy of each file (the model's own answer;
tests/model/test_{qwen3,smollm3,mistral3,gemma3}.py compare).

llama.cpp here is llama-server, built from the llama-cpp-python sdist's vendored source
(bench/llama_cpp_tools.sh: the same llama.cpp as the other goldens), with an f32 KV cache and
flash attention off (its CPU kernel works in f16: log-probabilities 5e-3 off, measured), on
loopback, its prompt cache off, greedy, one token a call (a call's steps are otherwise merged
where a token ends mid-character), and `n_probs` the size of the vocabulary (these files'
vocabularies are small), so each step's whole distribution comes back (no `ignore_eos`: it would
mask the end-of-generation tokens out of the distribution; none of these files' greedy tokens is
one).

Gemma 3's file is run twice: by the stock llama-server (its GELU an fp16 table lookup:
GGML_GELU_FP16 in ggml-cpu/vec.h, ~1e-2 off) and by one built with that lookup off
(`bench/llama_cpp_tools.sh --exact-gelu`), kept as "NAME@exact-gelu": the exact reference.

    bash bench/llama_cpp_tools.sh && bash bench/llama_cpp_tools.sh --exact-gelu
    .venv/bin/python -m tests.golden.families_llama_server
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.gguf_cases import LOGIT_STEPS, STEPS, Case
from tests.ggufs import file_sha256

GOLDEN = Path(__file__).with_name("families.json")
LLAMA_SERVER = Path.home() / ".cache/shardline/llama.cpp/build/bin/llama-server"
EXACT_GELU_SERVER = Path.home() / ".cache/shardline/llama.cpp-exact-gelu/build/bin/llama-server"
EXACT_GELU = "@exact-gelu"  # the suffix of a golden made by EXACT_GELU_SERVER


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def wait_healthy(port: int, tries: int = 1200) -> None:
    """Until llama-server on `port` answers /health (bounded: 0.1 s a try)."""
    for _ in range(tries):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("llama-server did not come up")


def golden(case: Case, folder: Path, binary: Path = LLAMA_SERVER) -> dict[str, Any]:
    quantized, f32 = case.write(folder), case.write(folder, dequantized=True)
    vocab, port = case.spec.vocab.size, _free_port()
    cmd = [str(binary), "-m", str(f32), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c",
           str(case.prompt_len + STEPS + 8), "-ctk", "f32", "-ctv", "f32", "--no-warmup", "-np", "1", "-fa", "off"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port)
        tokens, rows = [], {}
        for step in range(STEPS):  # one token a call: each step's whole distribution, unmerged
            # Only the steps kept ask for probabilities. llama-server leaves them out of a step
            # whose token ends mid-character (a byte token): such a step has no row.
            out = _post(port, {"prompt": case.prompt() + tokens, "n_predict": 1, "temperature": 0,
                               "n_probs": vocab if step in LOGIT_STEPS else 0, "cache_prompt": False,
                               "return_tokens": True, "post_sampling_probs": False})
            tokens.append(int(out["tokens"][0]))
            if step in LOGIT_STEPS and "completion_probabilities" in out:
                row = [-math.inf] * vocab
                for p in out["completion_probabilities"][0]["top_logprobs"]:
                    row[int(p["id"])] = float(p["logprob"])
                rows[str(step)] = row
    finally:
        server.kill()
        server.wait(timeout=30)
    return {"sha256": file_sha256(quantized), "tokens": tokens, "logprobs": rows}


def main() -> int:
    from tests.model import (
        test_gemma3,
        test_gptoss,
        test_mistral3,
        test_mixtral,
        test_qwen3,
        test_qwen3moe,
        test_smollm3,
    )

    version = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    out: dict[str, Any] = {"llama_server": (version.stdout + version.stderr).strip().splitlines()[0], "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(test_qwen3.CASE, LLAMA_SERVER, ""), (test_smollm3.CASE, LLAMA_SERVER, ""),
                (test_mistral3.CASE, LLAMA_SERVER, ""), (test_qwen3moe.CASE, LLAMA_SERVER, ""),
                (test_qwen3moe.TIES, LLAMA_SERVER, ""), (test_mixtral.CASE, LLAMA_SERVER, ""),
                (test_gptoss.CASE, LLAMA_SERVER, ""),
                (test_gemma3.CASE, LLAMA_SERVER, ""),
                (test_gemma3.CASE, EXACT_GELU_SERVER, EXACT_GELU)]
        for case, binary, suffix in runs:
            folder = Path(tmp) / (case.name + suffix)
            folder.mkdir()
            out["files"][case.name + suffix] = golden(case, folder, binary)
            print(case.name + suffix, out["files"][case.name + suffix]["tokens"][:8], file=sys.stderr)
    tmp_file = GOLDEN.with_suffix(".tmp")
    tmp_file.write_text(json.dumps(out, indent=1) + "\n")
    tmp_file.replace(GOLDEN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
