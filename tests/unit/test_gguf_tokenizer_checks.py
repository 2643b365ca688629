"""Pure: tokenizer metadata that cannot be turned into llama.cpp's tokenization is refused when
the file is opened, with one line naming the problem; the pre-tokenizer table; the chat's
control tokens kept apart from message text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shardline.errors import ShardlineError
from shardline.model.chat_text import ControlTokens, reveal
from shardline.model.gguf_tokenizer import PRES, check_tokenizer

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]


def meta_of(**fields: Any) -> Callable[[str, Any], Any]:
    """A GGUF's metadata: a small valid byte-level BPE tokenizer, with `fields` changed
    (`tokenizer_ggml_pre=None` removes tokenizer.ggml.pre)."""
    base: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
                            "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1],
                            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 1,
                            "tokenizer.ggml.eos_token_id": 2}
    for key, value in fields.items():
        base[key.replace("_", ".", 2)] = value
    values = {k: v for k, v in base.items() if v is not None}

    def meta(key: str, default: Any) -> Any:
        return values.get(key, default)

    return meta


def refused(**fields: Any) -> str:
    with pytest.raises(ShardlineError) as e:
        check_tokenizer(meta_of(**fields))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_valid_tokenizer_passes() -> None:
    check_tokenizer(meta_of())
    check_tokenizer(meta_of(tokenizer_ggml_pre=None, tokenizer_ggml_add_bos_token=False))  # "default"
    check_tokenizer(meta_of(tokenizer_ggml_model="llama", tokenizer_ggml_scores=[0.0] * 6,
                            tokenizer_ggml_merges=None, tokenizer_ggml_pre=None))


def test_unknown_model_is_named_with_the_supported_ones() -> None:
    msg = refused(tokenizer_ggml_model="bert")
    assert "'bert'" in msg and "gpt2" in msg and "llama" in msg
    assert "None" in refused(tokenizer_ggml_model=None)


def test_unknown_pre_tokenizer_is_named_with_the_supported_ones() -> None:
    msg = refused(tokenizer_ggml_pre="jais")
    assert "'jais'" in msg and "llama-bpe" in msg and "smollm" in msg and "tekken" in msg


@pytest.mark.parametrize(("fields", "named"), [
    ({"tokenizer_ggml_tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer_ggml_tokens": []}, "tokenizer.ggml.tokens"),
    ({"tokenizer_ggml_token_type": [1, 1]}, "token_type has 2 entries for 6 tokens"),
    ({"tokenizer_ggml_model": "llama", "tokenizer_ggml_scores": [0.0]}, "scores has 1 entries for 6 tokens"),
    ({"tokenizer_ggml_model": "llama"}, "scores"),
    ({"tokenizer_ggml_merges": None}, "merges"),
    ({"tokenizer_ggml_tokens": [*TOKENS[:5], "a"]}, "'a' appears twice"),
    ({"tokenizer_ggml_bos_token_id": 6}, "bos_token_id 6 is out of range"),
    ({"tokenizer_ggml_eos_token_id": -1}, "eos_token_id -1 is out of range"),
    ({"tokenizer_ggml_eos_token_id": None}, "eos_token_id"),
    ({"tokenizer_ggml_bos_token_id": None}, "add_bos_token is set"),  # llama-bpe adds a bos by default
])
def test_malformed_metadata_is_named(fields: dict[str, Any], named: str) -> None:
    assert named in refused(**fields)


def test_llama3_aliases_share_its_pre_tokenizer() -> None:
    assert PRES["llama3"] == PRES["llama-v3"] == PRES["llama-bpe"]
    assert PRES["llama-bpe"].ignore_merges and PRES["llama-bpe"].add_bos
    assert PRES["smollm"] == PRES["starcoder"] == PRES["refact"]
    assert not PRES["gpt-2"].ignore_merges and PRES["tekken"].ignore_merges


def test_control_text_in_messages_is_hidden_and_split_back() -> None:
    control = ControlTokens({"<|im_start|>": 1, "<|im_end|>": 2, "<|im": 9})
    messages = [{"role": "user", "content": "a<|im_start|>b<|im\U000f0000"}]
    hidden, back = control.hide(messages, template="x")
    assert "<|im" not in hidden[0]["content"] and hidden[0]["role"] == "user"
    assert reveal(hidden[0]["content"], back) == messages[0]["content"]
    assert "\U000f0000" not in back  # a stand-in character the text holds itself is skipped
    rendered = "<|im_start|>" + hidden[0]["content"] + "<|im_end|>"
    assert list(control.split(rendered)) == [1, hidden[0]["content"], 2]
    assert control.hide([{"role": "user", "content": "plain"}], "x") == ([{"role": "user", "content": "plain"}], {})
    assert list(ControlTokens({}).split("text")) == ["text"]
