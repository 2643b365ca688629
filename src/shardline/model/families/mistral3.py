"""Mistral 3 (Ministral 3, text), as llama.cpp runs a `mistral3` GGUF (src/models/mistral3.cpp
in the vendored source): the Llama layer (NORM-style rotary: the GGUF's Q/K rows permuted as
Llama's; optional biases), with YaRN rotary scaling and Llama 4's attention temperature, each
with llama.cpp's keys (Arch.rope_yarn, Arch.query_temperature). Its vision tower is another
file (mmproj), not read here."""

from __future__ import annotations

from shardline.model.families.base import Family
from shardline.model.families.llama import _hf_biases, llama_layer

MISTRAL3 = Family(name="mistral3", gguf_archs=("mistral3",), hf_model_types=(), layer=llama_layer,
                  hf_biases=_hf_biases, yarn=True)
FAMILIES = (MISTRAL3,)
