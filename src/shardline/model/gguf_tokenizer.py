"""Export time: a GGUF file's tokenizer metadata as `tokenizer.json` + `tokenizer_config.json`
that tokenize as llama.cpp does (llama-vocab.cpp), built from the `tokenizers` library's parts.

- Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): llama.cpp splits text with its
  pre-tokenizer's regexes one after another (each keeps the matches and the text between them:
  Split "isolated"), maps bytes to the GPT-2 alphabet, then merges by rank; some pre-tokenizers
  first take a whole piece that is in the vocabulary (BPE ignore_merges).
- SentencePiece (`"llama"`): llama.cpp prefixes every piece of text (the start, and after each
  special token) with a space, writes spaces as U+2581, merges the highest-scoring adjacent pair
  first and spells what is left as byte tokens. A BPE whose merges are every split of a token
  into two tokens, ranked by the token's score, makes the same choices (transformers converts
  SentencePiece the same way); its ties go by merge order where llama.cpp's go leftmost, which
  only differs when two different tokens have equal scores.
- Special tokens: CONTROL and UNKNOWN tokens are special added tokens (parsed only when asked,
  as llama.cpp's parse_special); USER_DEFINED ones are always split out (plain added tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from shardline.errors import ShardlineError

Meta = Callable[[str, Any], Any]

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
SPACE = "\u2581"
# Tokens llama.cpp makes control tokens by their text whatever the file says (its EOG list).
_EOG_NAMES = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})


@dataclass(frozen=True)
class Pre:
    """A byte-level BPE pre-tokenizer as llama.cpp runs it, and its defaults."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # when the file has no tokenizer.ggml.add_bos_token


# The regexes are llama.cpp's own forms (its "adapted" ones where it rewrote the original:
# `'[sS]` for `(?i:'s)`, lookaheads for tekken's letter cases), so that Oniguruma matches what
# llama.cpp's std::regex and hand-written splitters match.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o, gpt-oss's o200k_harmony): tekken's cased words, each with an optional contraction,
# and numbers of up to three digits.
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTION
          + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTION
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# deepseek-llm's letters: the cased ones (Unicode Lu, Ll, Lt) as its tokenizer lists them.
_CASED = ("A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
          "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
          "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
          "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
          "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
          "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
          "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
          "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
          "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
          "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_PUNCT_WIDE = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_GROUPS: list[tuple[tuple[str, ...], Pre]] = [
    (("default",), Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    (("gpt-2", "phi-2", "mpt", "olmo"), Pre((_GPT2,))),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), Pre((_LLAMA3,))),
    (("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"), Pre((r"\p{N}", _GPT2))),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), Pre((_QWEN2,))),
    (("tekken",), Pre((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o",), Pre((_GPT4O,))),
    (("deepseek-llm",), Pre(("[\r\n]", r"\s?[" + _CASED + "]+", r"\s?[" + _PUNCT_WIDE + "]+",
                             r"\s+\z", _CJK, r"\p{N}+"))),  # \z: llama.cpp's $ ends the piece only
    (("deepseek-coder",), Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"))),
]
PRES: dict[str, Pre] = {name: pre for names, pre in _GROUPS for name in names}


def _pre_name(meta: Meta) -> str:
    return str(meta("tokenizer.ggml.pre", "") or "default")  # llama.cpp: missing or empty is "default"


def check_tokenizer(meta: Meta) -> None:
    """Refuse, before anything is written, tokenizer metadata this module cannot turn into
    llama.cpp's tokenization."""
    model = meta("tokenizer.ggml.model", None)
    if model not in MODELS:
        supported = ", ".join(f"{k} ({v})" for k, v in MODELS.items())
        raise ShardlineError(f"unsupported tokenizer.ggml.model {model!r}: supported are {supported}")
    if model == "gpt2" and _pre_name(meta) not in PRES:
        raise ShardlineError(f"unsupported tokenizer.ggml.pre {_pre_name(meta)!r}: supported are "
                             f"{', '.join(sorted(PRES))}")
    tokens = meta("tokenizer.ggml.tokens", None)
    if not tokens:
        raise ShardlineError("the GGUF file has no tokenizer.ggml.tokens")
    for key in ("token_type", "scores"):
        values = meta(f"tokenizer.ggml.{key}", None)
        if values is not None and len(values) != len(tokens):
            raise ShardlineError(f"tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")
    if model == "llama" and meta("tokenizer.ggml.scores", None) is None:
        raise ShardlineError("a SentencePiece tokenizer needs tokenizer.ggml.scores (they order its merges)")
    if model == "gpt2" and not meta("tokenizer.ggml.merges", None):
        raise ShardlineError("a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    seen: dict[str, int] = {}
    for i, t in enumerate(_texts(tokens)):
        if seen.setdefault(t, i) != i:
            raise ShardlineError(f"token {t!r} appears twice in tokenizer.ggml.tokens (ids {seen[t]} and {i})")
    _special_ids(meta, len(tokens))


def _texts(tokens: list[Any]) -> list[str]:
    # llama.cpp names an empty token "[EMPTY_<id>]", so that every token has a text of its own.
    return [str(t) or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _special_ids(meta: Meta, n: int) -> tuple[int | None, int, bool]:
    """(bos, eos, add_bos), with llama.cpp's defaults for SentencePiece (bos 1, eos 2, add bos)."""
    spm = meta("tokenizer.ggml.model", None) == "llama"
    ids: list[int | None] = []
    for name, default in (("bos", 1 if spm else None), ("eos", 2 if spm else None)):
        value = meta(f"tokenizer.ggml.{name}_token_id", default)
        if value is not None and not 0 <= int(value) < n:
            raise ShardlineError(f"tokenizer.ggml.{name}_token_id {value} is out of range (vocabulary of {n})")
        ids.append(None if value is None else int(value))
    bos, eos = ids
    if eos is None:
        raise ShardlineError("the GGUF file has no tokenizer.ggml.eos_token_id")
    add_bos = bool(meta("tokenizer.ggml.add_bos_token", spm or PRES[_pre_name(meta)].add_bos))
    if add_bos and bos is None:
        raise ShardlineError("tokenizer.ggml.add_bos_token is set but the file has no tokenizer.ggml.bos_token_id")
    return bos, eos, add_bos


def write_tokenizer_files(meta: Meta, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (what model/tokenizer.py reads) into `out`."""
    check_tokenizer(meta)
    tokens = _texts(meta("tokenizer.ggml.tokens", None))
    types = [int(t) for t in meta("tokenizer.ggml.token_type", None) or [NORMAL] * len(tokens)]
    spm = meta("tokenizer.ggml.model", None) == "llama"
    tok = _sentencepiece(meta, tokens) if spm else _byte_level(meta, tokens)
    _add_specials(tok, tokens, types)
    tok.save(str(out / "tokenizer.json"))
    bos, eos, add_bos = _special_ids(meta, len(tokens))
    cfg = {
        "chat_template": meta("tokenizer.chat_template", None),
        "bos_token": "" if bos is None else tokens[bos],
        "eos_token": tokens[eos],
        "add_bos_token": add_bos,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _byte_level(meta: Meta, tokens: list[str]) -> Tokenizer:
    pre = PRES[_pre_name(meta)]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for m in meta("tokenizer.ggml.merges", None):
        cut = str(m).find(" ", 1)  # as llama.cpp: a first part may itself be a space
        a, b = str(m)[:cut], str(m)[cut + 1:]
        if cut > 0 and a in vocab and b in vocab and a + b in vocab:  # tokenizers refuses the others
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre.ignore_merges))
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: Meta, tokens: list[str]) -> Tokenizer:
    scores = [float(s) for s in meta("tokenizer.ggml.scores", None)]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_score_merges(tokens, scores, vocab), unk_token=unk,
                               fuse_unk=False, byte_fallback=True))
    prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    # Prepend runs on every piece of text between added tokens: llama.cpp's space after each
    # special token (its is_prev_special) as well as at the start.
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tail = [decoders.Strip(" ", 1, 0)] if prefix else []  # the prefix space is not the text's
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return tok


def _score_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the best-scoring token's first: what llama.cpp's
    SentencePiece loop merges, in the order it prefers them."""
    found = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                found.append((-scores[i], i, k))
    found.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in found]


def _add_specials(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    control = [t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, UNKNOWN) or t in _EOG_NAMES]
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t not in _EOG_NAMES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
