"""Small tokenizer vocabularies of their own for the hand-built GGUF files (tests only).

A byte-level BPE vocabulary is learnt here from a fixed corpus by a tiny deterministic BPE
learner (most frequent pair first, ties to the smallest pair), so the vocabulary, and with it a
file's sha256, never depends on a library's training code. The SentencePiece vocabulary's
pieces are learnt the same way (on characters, spaces as U+2581), scored by the order learnt.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away!
What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.
In 2026 there were 123456 people, 42 cats and 3.14159 pies. Call 555-0123 or 1-800-123-4567.
def main(x):\n    return x ** 2 + 10\n\nfor i in range(100):\n    print(i, i * i)\n
Hello, world! Hello again, world... It's a test: don't stop, we'll see, they've gone, I'm here.
    indented line\n\n\nthree newlines\r\nwindows line\ttab\t\ttwo tabs   three spaces
naïve café résumé über straße, 日本語のテキスト, русский текст, 中文文本, emoji 🙂🚀
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


_WORDS = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+")


def learn_bpe(corpus: str, n_merges: int, to_symbols: Any) -> list[tuple[str, str]]:
    """Merges learnt from the corpus' words, each a tuple of symbols (`to_symbols(word)`)."""
    words = Counter(tuple(to_symbols(w)) for w in _WORDS.findall(corpus))
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = Counter({_merge(w, best): n for w, n in words.items()})
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


@dataclass(frozen=True)
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None  # tokenizer.ggml.pre (BPE only)
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    bos: int | None = None
    eos: int = 0
    add_bos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = CHATML

    @property
    def size(self) -> int:
        return len(self.tokens)

    def write(self, w: Any) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.merges:
            w.add_token_merges(self.merges)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.bos is not None:
            w.add_bos_token_id(self.bos)
        w.add_eos_token_id(self.eos)
        w.add_add_bos_token(self.add_bos)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


@cache
def _byte_level(n_merges: int, corpus: str = CORPUS) -> tuple[list[str], list[str]]:
    alphabet = bytes_to_unicode()

    def symbols(word: str) -> list[str]:
        return [alphabet[b] for b in word.encode()]

    merges = learn_bpe(corpus, n_merges, symbols)
    tokens = sorted(set(alphabet.values()))
    tokens += [a + b for a, b in merges if a + b not in tokens]
    return tokens, [f"{a} {b}" for a, b in merges]


def byte_level_vocab(pre: str = "gpt-2", n_merges: int = 300) -> Vocab:
    """ChatML specials (ids 0-2, as SmolLM2), the 256 byte symbols, then the learnt merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens, merges = _byte_level(n_merges)
    return Vocab(model="gpt2", pre=pre, tokens=specials + tokens, merges=merges,
                 types=[CONTROL] * len(specials) + [NORMAL] * len(tokens), bos=1, eos=2)


# The tokenizer tests' own vocabularies (tests/model/test_gguf_tokenizers.py, goldens by
# tests/golden/tokenize_llama_cpp.py): learnt from more text (numbers, whitespace and newline
# runs, contractions in both cases, several scripts), one per tokenizer kind.
MORE_TEXT = """1000 2000 10000 999 1234567890 3.14 0.5 1,000,000 42 7 12 34 56 78 90 100 2024 2025 2026
!!! ??? ... --- *** /// (a) [b] {c} $100 + 5% = <ok> a+b=c^2 x=42; y=7; z == w != v
IT'S DON'T WE'LL THEY'VE I'M YOU'D WE'RE it's don't we'll they've I'm you'd we're
a  b   c    d\ttab\t\ttabs\n\nparagraph\n\n\nthree\r\nwindows\r\n\r\ncrlf  \n  \n    code
ПРИВЕТ мир Привет, как дела? Спасибо. हिन्दी नमस्ते. مرحبا بالعالم. 한국어 텍스트. 日本語と中文。
"""
TOKENIZER_CORPUS = CORPUS + MORE_TEXT
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST]' + message['content'] + '[/INST]' }}{% else %}{{ message['content'] + eos_token }}"
                    "{% endif %}{% endfor %}")
LLAMA2_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                   "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + "
                   "eos_token }}{% endif %}{% endfor %}")
# Special tokens (control, then user-defined), bos, eos, add_bos and chat template per family.
FAMILIES: dict[str, tuple[list[str], list[str], int, int, bool, str]] = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [], 1, 2, False, CHATML),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], 1, 2, False, CHATML),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               [], 0, 4, True, LLAMA3_TEMPLATE),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], [], 1, 2, True, MISTRAL_TEMPLATE),
}
# Whole pieces in the vocabulary that no merge makes: only a pre-tokenizer with ignore_merges
# (llama3, tekken) gives them as one token.
WHOLE_PIECES = [" CamelCaseWords", "\n\n\n\n", " ПРИВЕТ", "    "]


def bpe_vocab(pre: str | None, family: str = "chatml", n_merges: int = 400) -> Vocab:
    """A byte-level BPE vocabulary of its own: the family's specials, the 256 byte symbols, the
    merges learnt from TOKENIZER_CORPUS, the whole pieces, then the user-defined tokens."""
    control, user, bos, eos, add_bos, template = FAMILIES[family]
    tokens, merges = _byte_level(n_merges, TOKENIZER_CORPUS)
    alphabet = bytes_to_unicode()
    whole = ["".join(alphabet[b] for b in p.encode()) for p in WHOLE_PIECES]
    normal = tokens + [w for w in whole if w not in tokens]
    types = [CONTROL] * len(control) + [NORMAL] * len(normal) + [USER_DEFINED] * len(user)
    return Vocab(model="gpt2", pre=pre, tokens=control + normal + user, types=types, merges=merges, bos=bos, eos=eos,
                 add_bos=add_bos, chat_template=template)


def spm_vocab(add_space_prefix: bool | None = None, n_merges: int = 400) -> Vocab:
    """A SentencePiece vocabulary as Llama 2's: <unk>, <s>, </s>, the 256 byte tokens <0xNN>,
    the pieces learnt from TOKENIZER_CORPUS (spaces as U+2581; the later a piece is learnt, the
    lower its score), the single characters (lowest scores; none for the controls, newlines and
    tabs, which fall back to bytes, as in Llama's vocabulary), and one user-defined token."""
    def symbols(word: str) -> list[str]:
        return [] if any(c in word for c in "\n\r\t") else list(word.replace(" ", "\u2581"))

    merges = learn_bpe(TOKENIZER_CORPUS, n_merges, symbols)
    pieces = list(dict.fromkeys(a + b for a, b in merges))
    chars = sorted(set(TOKENIZER_CORPUS.replace(" ", "\u2581")) - set("\n\r\t") - set(pieces))
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + pieces + chars + ["<tool>"]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(chars)) + [USER_DEFINED]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1000.0 - i for i in range(len(chars))] + [0.0]
    return Vocab(model="llama", pre=None, tokens=tokens, types=types, scores=scores, bos=1, eos=2, add_bos=True,
                 add_space_prefix=add_space_prefix, chat_template=LLAMA2_TEMPLATE)


def write_vocab_only(vocab: Vocab, path: Path, name: str) -> Path:
    """A GGUF file with the tokenizer and a tiny Llama's hyper-parameters but no tensors: what
    llama.cpp opens with vocab_only (deterministic bytes, so a fixed sha256)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    vocab.write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Gemma's chat format, written here: no system role (a system message opens the first user
# turn), the assistant's turns are the "model" role's.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set first = 0 %}{% set system = '' %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}{% set first = 1 %}"
    "{% endif %}{% for message in messages[first:] %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def gemma_vocab() -> Vocab:
    """Gemma's kind of vocabulary: SentencePiece without a space prefix, BOS added, its turn
    markers as control tokens, its chat template."""
    v = spm_vocab(add_space_prefix=False)
    turns = ["<start_of_turn>", "<end_of_turn>"]
    return Vocab(model=v.model, pre=None, tokens=v.tokens + turns, types=v.types + [CONTROL, CONTROL],
                 scores=(v.scores or []) + [0.0, 0.0], bos=v.bos, eos=v.eos, add_bos=True, add_space_prefix=False,
                 chat_template=GEMMA_TEMPLATE)
