"""Run-time tokenizer and chat template: needs only `tokenizers` and `jinja2` (no torch)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shardline.errors import ShardlineError
from shardline.model.chat_text import ControlTokens, reveal
from shardline.model.tool_calls import ToolSyntax, detect

END_OF_GENERATION = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
                     "<end_of_turn>", "</s>", "<EOT>", "<|return|>", "<|call|>")
# Harmony (gpt-oss): <|end|> closes a message (its analysis) but not the turn, which ends at
# <|return|> or <|call|>; llama.cpp drops <|end|> from its stops where both are in the vocabulary.
HARMONY_ENDS = ("<|return|>", "<|call|>")


def _raise_exception(message: str) -> NoReturn:
    """What chat templates call to refuse a conversation (as transformers provides it)."""
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Today's date as templates ask for it (transformers and llama.cpp provide it; gpt-oss's
    harmony template and Llama 3.x's write the current date into the system turn)."""
    return datetime.datetime.now().strftime(str(fmt))


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """JSON as the templates' authors see it rendered (transformers' and llama.cpp's `tojson`):
    not jinja2's, which escapes <, > and & for HTML."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def template_text(given: str) -> str:
    """`serve --chat-template`: a built-in template by name (model/templates/) or a file's text."""
    builtin = resources.files("shardline.model.templates") / f"{given}.jinja"
    try:
        text = builtin.read_text() if builtin.is_file() else Path(given).read_text()
    except (OSError, UnicodeDecodeError) as e:
        names = sorted(p.name.removesuffix(".jinja") for p in resources.files("shardline.model.templates").iterdir()
                       if p.name.endswith(".jinja"))
        raise ShardlineError(f"--chat-template {given}: neither a built-in ({', '.join(names)}) nor a readable "
                             f"file: {e}") from None
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateError as e:
        raise ShardlineError(f"--chat-template {given}: not a Jinja template: {e}") from None
    return text


class ChatTokenizer:
    def __init__(self, folder: Path, template: str | None = None) -> None:
        """`template`: a chat template in place of the export's (`serve --chat-template`)."""
        try:
            spec = (folder / "tokenizer.json").read_text()
            self._tok = Tokenizer.from_str(spec)
            self._plain = Tokenizer.from_str(spec)  # the same, its special tokens never parsed
            self._plain.encode_special_tokens = True
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError, Exception) as e:
            raise ShardlineError(f"cannot load the tokenizer in {folder}: {e}") from None
        self.eos_token: str = cfg["eos_token"]
        eos_id = self._tok.token_to_id(self.eos_token)
        if eos_id is None:
            raise ShardlineError(f"the eos token {self.eos_token!r} is not in the vocabulary of {folder}")
        self.eos_id: int = eos_id
        self.add_bos: bool = bool(cfg.get("add_bos_token", False))
        self.bos_token: str = cfg.get("bos_token") or ""
        self.bos_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._source: str = template if template is not None else (cfg.get("chat_template") or "")
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self._source) if self._source else None
        except TemplateError as e:
            raise ShardlineError(f"the chat template cannot be read: {e}") from None
        self._control = ControlTokens(
            {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special})
        # Chat models stop at the end of their turn as well as at the declared eos: the
        # end-of-generation tokens llama.cpp knows by name, where the vocabulary has them.
        ends = {t: i for t in END_OF_GENERATION
                if (i := self._tok.token_to_id(t)) is not None and t in self._control.ids}
        if set(HARMONY_ENDS) <= ends.keys():
            ends.pop("<|end|>", None)
        self.stop_ids = {self.eos_id, *ends.values()}

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @property
    def raw(self) -> Tokenizer:
        """The `tokenizers` Tokenizer itself (its vocabulary: token strings and bytes)."""
        return self._tok

    def tokens(self, text: str, parse_special: bool = True) -> list[int]:
        """The ids of `text` alone (no BOS); special tokens in it parsed or left as text."""
        # encode_batch, not encode: it releases the GIL while it works, so a long prompt being
        # tokenized on a worker thread does not stall the server's event loop (measured 1-1.7 s
        # for a 1.9 MB prompt with encode).
        tok = self._tok if parse_special else self._plain
        return list(tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode(self, text: str) -> list[int]:
        ids = self.tokens(text)
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    @property
    def control_tokens(self) -> frozenset[str]:
        """The texts of the vocabulary's special tokens."""
        return frozenset(self._control.ids)

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        """How the template renders tool calls (None: it renders none)."""
        return detect(self._source, frozenset(self._control.ids))

    def chat_prompt(self, messages: list[dict[str, Any]], extra: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The template rendered; `extra`: more variables it may read (a request's
        chat_template_kwargs, e.g. Qwen3's enable_thinking), never one of those set here;
        `tools`: the functions offered, in OpenAI's form (None: none, and no `tools` variable)."""
        if self._template is None:
            raise ShardlineError("this model has no chat template")
        offered = {"tools": tools} if tools else {}
        own = {"messages": messages, "add_generation_prompt": True}
        return str(self._template.render({**(extra or {}), **offered, **own,
                                          "bos_token": self.bos_token, "eos_token": self.eos_token,
                                          "raise_exception": _raise_exception, "strftime_now": _strftime_now}))

    def encode_chat(self, messages: list[dict[str, Any]], extra: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered template's ids: its own control tokens, and every piece of text between
        them with special tokens left as text, so a message (or a tool's description) never
        smuggles in a control token."""
        (hidden, offered), back = self._control.hide([messages, tools], self._source)
        prompt = self.chat_prompt(hidden, extra, offered)
        pieces = list(self._control.split(prompt))
        texts = [reveal(p, back) for p in pieces if isinstance(p, str)]
        encoded = iter(self._plain.encode_batch(texts, add_special_tokens=False))  # releases the GIL
        ids = [i for p in pieces for i in ([p] if isinstance(p, int) else next(encoded).ids)]
        if self.add_bos and self.bos_id is not None and not prompt.startswith(self.bos_token):
            ids = [self.bos_id, *ids]  # a template that writes the bos itself gets no second one
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode_batch([ids], skip_special_tokens=True)[0])


class StreamDecoder:
    """Text deltas of tokens as they come (`tokenizers`' DecodeStream: constant work per token,
    incomplete UTF-8 sequences held back until a later token completes them)."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._tok = tok.raw
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token: int) -> str:
        return self._stream.step(self._tok, token) or ""
