"""Export time: rebuild a byte-level BPE tokenizer from a GGUF vocabulary and merges.

transformers' GGUF conversion of SmolLM2 gives a broken tokenizer (extra <|im_start|>,
Metaspace instead of ByteLevel, wrong eos). Rebuilt from the same vocabulary and merges, with
digits split one by one before the byte-level step (as the original tokenizer and llama.cpp's
"smollm" pre-tokenizer do), it gives the same ids llama.cpp gives.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizers that split digits one at a time before the byte-level regex.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "qwen2", "deepseek-llm", "deepseek-coder"}


def build_gguf_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre in _DIGIT_SPLIT:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
               if k in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok
