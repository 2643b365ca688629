"""SmolLM3, as llama.cpp runs a `smollm3` GGUF (src/models/smollm3.cpp in the vendored source):
the Llama layer (NORM-style rotary, so the GGUF's Q/K rows are permuted as Llama's), except that
every fourth layer (3, 7, 11, ...) has no rotary positions at all (NoPE: llama.cpp's
n_no_rope_layer_step = 4; Hugging Face's no_rope_layers)."""

from __future__ import annotations

from shardline.model.families.base import Family
from shardline.model.families.llama import _hf_biases, llama_layer

SMOLLM3 = Family(name="smollm3", gguf_archs=("smollm3",), hf_model_types=(), layer=llama_layer,
                 hf_biases=_hf_biases, unrotated_every=4)
FAMILIES = (SMOLLM3,)
