"""The hand-built model files checked against llama.cpp: one per weight type, the mixes people
download, the architectures and their quirks. Shared by the tests and the golden script
(tests/golden/models_llama_cpp.py), so both build byte-identical files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.ggufs import ALL_TYPES, Q4_K_M, FileSpec, write

STEPS = 32  # greedy tokens compared
LOGIT_STEPS = (0, 1, 15, 31)  # the steps whose whole logits row the goldens keep
LONG_PROMPT = 2000  # tokens, for the rope scaling case (where rope_freqs matters most)


@dataclass(frozen=True)
class Case:
    spec: FileSpec
    split: int = 0  # tensors per part (0: one file)
    prompt_len: int = 12

    @property
    def name(self) -> str:
        return self.spec.name

    def prompt(self) -> list[int]:
        """Token ids only (no tokenizer involved): a fixed walk over the vocabulary."""
        v = self.spec.vocab.size
        return [(17 + 37 * i + (i * i) % 11) % (v - 3) + 3 for i in range(self.prompt_len)]

    def write(self, folder: Path, dequantized: bool = False) -> Path:
        """The file (the first part of a split one), or its dequantized F32 copy (one file)."""
        name = f"{self.name}-f32.gguf" if dequantized else f"{self.name}.gguf"
        return write(self.spec, folder / name, dequantized=dequantized, split_tensors=0 if dequantized else self.split)


CASES: dict[str, Case] = {c.name: c for c in [
    *(Case(FileSpec(name=f"llama-{t}", weights=t)) for t in ALL_TYPES),
    Case(FileSpec(name="llama-Q4_K_M", mix=Q4_K_M)),
    Case(FileSpec(name="llama-tied-Q6_K", weights="Q6_K", tied=True)),
    Case(FileSpec(name="llama-tied-Q2_K", weights="Q2_K", tied=True)),
    Case(FileSpec(name="qwen2-Q4_K", arch="qwen2", weights="Q4_K", biases=True, tied=True, rope_theta=1e6)),
    Case(FileSpec(name="llama31-rope-freqs", weights="Q4_K", rope_freqs=True, rope_theta=500000.0),
         prompt_len=LONG_PROMPT),
    Case(FileSpec(name="llama-split-Q4_K", weights="Q4_K"), split=8),
    Case(FileSpec(name="llama-rope-linear-Q8_0", weights="Q8_0",
                  extra_keys={"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}),
         prompt_len=300),
]}
