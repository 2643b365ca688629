"""Regenerate tests/golden/fast.json: llama.cpp's own answer on the real quantized file itself
(Qwen2.5-Coder-0.5B-Instruct Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 blocks), the reference for
`--precision fast`, which runs the file's blocks with int8 activations as llama.cpp's CPU kernels
do (tests/model/test_real_weights.py compares).

llama-server (bench/llama_cpp_tools.sh: the llama.cpp the other goldens use) at its defaults but
for flash attention off (its CPU kernel computes in f16, not what shardline's attention does) and
its f16 KV cache kept (shardline's `fast` keeps f16 too); 2 threads, greedy, one token a call
(each step's own top log-probabilities), for every prompt of tests/real_models.py, FAST_STEPS
tokens each. Kept per step: the token, its log-probability, and the margin to the runner-up.

    bash bench/llama_cpp_tools.sh
    .venv/bin/python -m tests.golden.fast_llama_server
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardline.export.pull import pull
from shardline.model.catalog import named
from tests.golden.families_llama_server import LLAMA_SERVER, _free_port, _post, wait_healthy
from tests.real_models import goldens

GOLDEN = Path(__file__).with_name("fast.json")
NAME = "qwen2.5-coder-0.5b"
FAST_STEPS = 32


def case(port: int, ids: list[int]) -> dict[str, Any]:
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    for _ in range(FAST_STEPS):
        out = _post(port, {"prompt": ids + tokens, "n_predict": 1, "temperature": 0, "n_probs": 2,
                           "cache_prompt": True, "return_tokens": True, "post_sampling_probs": False})
        tokens.append(int(out["tokens"][0]))
        top = out["completion_probabilities"][0]["top_logprobs"]
        assert int(top[0]["id"]) == tokens[-1]
        logprobs.append(float(top[0]["logprob"]))
        margins.append(float(top[0]["logprob"]) - float(top[1]["logprob"]))
    return {"ids": ids, "tokens": tokens, "logprobs": logprobs, "margins": margins}


def main() -> int:
    model = pull(named(NAME))
    port = _free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c",
           "1024", "--no-warmup", "-np", "1", "-fa", "off"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port)
        cases = [case(port, c["ids"]) for c in goldens()[NAME]["cases"]]
    finally:
        server.kill()
        server.wait(timeout=30)
    version = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    out = {"llama_server": (version.stdout + version.stderr).strip().splitlines()[0], "model": NAME,
           "sha256": named(NAME).sha256, "cases": cases}
    tmp = GOLDEN.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(GOLDEN)
    print(f"{len(cases)} cases written to {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
