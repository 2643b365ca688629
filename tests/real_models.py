"""The real model files of `shardline pull` as test subjects: the prompts every real-weight check
uses (code completion, code editing, chat, numbers, CJK, emoji), and transformers' fp32 answers
on the file's dequantized weights (tests/golden/real_models.json, from
`python -m tests.golden.real_transformers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "golden" / "real_models.json"
STEPS = 48
TOP = 32  # logits kept per checked row: the reference's highest TOP, by id

EDIT_SOURCE = '''def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)
'''

PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Complete this code:\n\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci "
                                 "number.\"\"\"\n"}],
    [{"role": "user", "content": "Rewrite this function so it returns 0.0 for an empty list and uses "
                                 f"sum():\n\n{EDIT_SOURCE}"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France, and why is it famous?"}],
    [{"role": "user", "content": "What is 1234 * 5678? Show the steps."}],
    [{"role": "user", "content": "用一句话解释什么是递归。"}],
    [{"role": "user", "content": "Write a SQL query that counts orders per customer 🧾, newest first."}],
    [{"role": "user", "content": "Explain the difference between a list and a tuple in Python."}],
]


def goldens() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data["models"]
