"""Every tokenizer kind a Llama-family GGUF uses tokenizes as llama.cpp does, token for token.

Each kind is a small vocabulary of its own in a vocab-only GGUF (tests/gguf_vocab.py, built the
same way by tests/golden/tokenize_llama_cpp.py); llama.cpp's ids for the torture corpus, with
special tokens parsed and not, and for one chat are in tests/golden/tokenize.json. The
tokenizer under test is the one an export writes (model/gguf_tokenizer.py), read back as the
server reads it (model/tokenizer.py).
"""

from __future__ import annotations

import json
from typing import Any

import gguf
import pytest

from shardline.model.gguf_tokenizer import write_tokenizer_files
from shardline.model.tokenizer import ChatTokenizer, StreamDecoder
from tests.ggufs import file_sha256
from tests.golden.tokenize_llama_cpp import CORPUS, GOLDEN, KINDS, build

REGENERATE = "regenerate the golden: .venv/bin/python -m tests.golden.tokenize_llama_cpp"
_GOLDEN: dict[str, Any] = json.loads(GOLDEN.read_text())["kinds"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChatTokenizer]:
    """kind -> the exported tokenizer of the kind's GGUF (the very file the golden names)."""
    made = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        path = build(kind, folder)
        assert file_sha256(path) == _GOLDEN[kind]["sha256"], f"{kind}: the GGUF file changed; {REGENERATE}"
        reader = gguf.GGUFReader(str(path))

        def meta(key: str, default: Any = None, fields: Any = reader.fields) -> Any:
            return default if key not in fields else fields[key].contents()

        write_tokenizer_files(meta, folder)
        made[kind] = ChatTokenizer(folder)
    return made


def _mismatches(tok: ChatTokenizer, kind: str, mode: str) -> list[str]:
    out = []
    for e in _GOLDEN[kind]["texts"]:
        ours = tok.tokens(e["text"], parse_special=mode == "special")
        if ours != e[mode]:
            raw = tok.raw
            out.append(f"{e['text']!r}: ours {[raw.id_to_token(i) for i in ours]}, "
                       f"llama.cpp {[raw.id_to_token(i) for i in e[mode]]}")
    return out


def test_golden_covers_the_corpus() -> None:
    for kind in KINDS:
        assert [e["text"] for e in _GOLDEN[kind]["texts"]] == CORPUS, f"{kind}: the corpus changed; {REGENERATE}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_plain_text_ids_are_llama_cpps(tokenizers: dict[str, ChatTokenizer], kind: str) -> None:
    assert not (bad := _mismatches(tokenizers[kind], kind, "plain")), "\n".join(bad)


@pytest.mark.parametrize("kind", list(KINDS))
def test_ids_with_special_tokens_parsed_are_llama_cpps(tokenizers: dict[str, ChatTokenizer], kind: str) -> None:
    assert not (bad := _mismatches(tokenizers[kind], kind, "special")), "\n".join(bad)


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_gives_the_text_back_where_llama_cpps_does(tokenizers: dict[str, ChatTokenizer], kind: str) -> None:
    tok = tokenizers[kind]
    lossless = [e for e in _GOLDEN[kind]["texts"] if e["detok"] == e["text"]]
    assert len(lossless) >= len(CORPUS) - 3
    assert [e["text"] for e in lossless if tok.decode(e["plain"]) != e["text"]] == []

    def streamed(ids: list[int]) -> str:
        out = StreamDecoder(tok)
        return "".join(out.push(i) for i in ids)

    assert [e["text"] for e in lossless if streamed(e["plain"]) != e["text"]] == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_chat_message_never_becomes_control_tokens(tokenizers: dict[str, ChatTokenizer], kind: str) -> None:
    chat = _GOLDEN[kind]["chat"]
    assert tokenizers[kind].encode_chat(chat["messages"]) == chat["ids"]


def test_pre_tokenizers_differ_where_llama_cpps_do(tokenizers: dict[str, ChatTokenizer]) -> None:
    """The issue's measurements: llama-bpe groups digits by three and keeps newline runs whole."""
    llama3 = tokenizers["llama-bpe"]
    assert [llama3.raw.id_to_token(i) for i in llama3.tokens("123456")] == ["123", "456"]
    assert len(llama3.tokens("\n\n")) == len(llama3.tokens("\r\n")) == 1
    smollm = tokenizers["smollm"]
    assert [smollm.raw.id_to_token(i) for i in smollm.tokens("123456")] == list("123456")


def test_sentencepiece_spells_unknown_characters_as_bytes(tokenizers: dict[str, ChatTokenizer]) -> None:
    spm = tokenizers["spm"]
    pieces = [spm.raw.id_to_token(i) for i in spm.tokens("👍\n")]
    assert pieces == ["\u2581", "<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "<0x0A>"]
    assert spm.decode(spm.tokens("👍\n")) == "👍\n"
    assert spm.encode("hi")[0] == spm.bos_id  # SentencePiece adds the bos unless the file says not
