"""Regenerate tests/golden/families.json: llama.cpp's answer for the hand-built files of the
families llama-cpp-python's goldens do not cover yet (Qwen3): greedy tokens and, at the steps
LOGIT_STEPS names, the log-probabilities of every token of the vocabulary, on the dequantized
f32 copy of each file (the model's own answer; tests/model/test_qwen3.py compares).

llama.cpp here is llama-server, built from the llama-cpp-python sdist's vendored source
(bench/llama_cpp_tools.sh: the same llama.cpp as the other goldens), with an f32 KV cache and
flash attention off (its CPU kernel works in f16: log-probabilities 5e-3 off, measured), on
loopback, its prompt cache off, greedy, one token a call (a call's steps are otherwise merged
where a token ends mid-character), and `n_probs` the size of the vocabulary (these files'
vocabularies are small), so each step's whole distribution comes back (no `ignore_eos`: it would
mask the end-of-generation tokens out of the distribution; none of these files' greedy tokens is
one).

    bash bench/llama_cpp_tools.sh && .venv/bin/python -m tests.golden.families_llama_server
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def golden(case: Case, folder: Path) -> dict[str, Any]:
    quantized, f32 = case.write(folder), case.write(folder, dequantized=True)
    vocab, port = case.spec.vocab.size, _free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(f32), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c",
           str(case.prompt_len + STEPS + 8), "-ctk", "f32", "-ctv", "f32", "--no-warmup", "-np", "1", "-fa", "off"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        tokens, rows = [], {}
        for step in range(STEPS):  # one token a call: each step's whole distribution, unmerged
            out = _post(port, {"prompt": case.prompt() + tokens, "n_predict": 1, "temperature": 0,
                               "n_probs": vocab, "cache_prompt": False, "return_tokens": True,
                               "post_sampling_probs": False})
            tokens.append(int(out["tokens"][0]))
            if step in LOGIT_STEPS:
                row = [-math.inf] * vocab
                for p in out["completion_probabilities"][0]["top_logprobs"]:
                    row[int(p["id"])] = float(p["logprob"])
                rows[str(step)] = row
    finally:
        server.kill()
        server.wait(timeout=30)
    return {"sha256": file_sha256(quantized), "tokens": tokens, "logprobs": rows}


def main() -> int:
    from tests.model.test_qwen3 import CASE

    version = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    out: dict[str, Any] = {"llama_server": (version.stdout + version.stderr).strip().splitlines()[0], "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case in (CASE,):
            folder = Path(tmp) / case.name
            folder.mkdir()
            out["files"][case.name] = golden(case, folder)
            print(case.name, out["files"][case.name]["tokens"][:8], file=sys.stderr)
    tmp_file = GOLDEN.with_suffix(".tmp")
    tmp_file.write_text(json.dumps(out, indent=1) + "\n")
    tmp_file.replace(GOLDEN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
