"""Regenerate tests/golden/real_models.json: transformers' fp32 greedy answers on the real model
files of `shardline pull`, read with its own GGUF loader (`gguf_file=`: gguf-py's dequantization,
its own tokenizer and chat template).

    .venv/bin/python -m tests.golden.real_transformers [NAME ...]     (default: every catalogued model)

For each of tests/real_models.py's prompts: the chat prompt's ids as transformers' tokenizer makes
them, 48 greedy tokens, and the TOP highest logits of the first and the last step (ids, values).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch

from shardline.export.pull import pull
from shardline.model.catalog import CATALOG, named
from tests.model.reference import greedy_reference
from tests.real_models import GOLDEN, PROMPTS, STEPS, TOP

torch.set_num_threads(2)


def top(row: np.ndarray) -> dict[str, list[Any]]:
    ids = np.argsort(-row, kind="stable")[:TOP]
    return {"ids": [int(i) for i in ids], "values": [float(row[i]) for i in ids]}


def golden(name: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = named(name)
    path = pull(model)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    cases = []
    for messages in PROMPTS:
        ids = [int(i) for i in tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)]
        t = time.perf_counter()
        tokens, rows = greedy_reference(lm, ids, STEPS)
        print(f"{name}: {len(ids)} + {STEPS} tokens in {time.perf_counter() - t:.1f} s: "
              f"{tok.decode(tokens)[:60]!r}", flush=True)
        cases.append({"ids": ids, "tokens": tokens, "first": top(rows[0]), "last": top(rows[-1])})
    return {"sha256": model.sha256, "cases": cases}


def main(names: list[str]) -> int:
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"models": {}}
    import transformers

    data["transformers"] = transformers.__version__
    for name in names or list(CATALOG):
        data["models"][name] = golden(name)
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
