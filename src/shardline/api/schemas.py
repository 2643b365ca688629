"""OpenAI request and response shapes. OpenAI's types stop here: the engine sees a `Request`.

Every field a client sends is checked here, before anything else runs: types are strict (a
boolean is not a number, a numeric string is not a number, NaN and infinities are refused) and
values are range-checked, so that nothing a client sends reaches the sampler or the tokenizer
in a form that could fail there. Parsing errors name the field (`param`); fields we parse but
cannot honour are refused by `refusals()` with code `unsupported_parameter`, never ignored.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from shardline.config import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, MAX_TOP_LOGPROBS, MIN_TEMPERATURE
from shardline.model.grammar import Grammars, GrammarSpec

Constrained = GrammarSpec | Callable[[Grammars], Any]  # a spec, or what builds the constraint (api/constrain.py)
Int = Annotated[int, Strict()]  # JSON integers only: no true/false, no 1.0, no "1"
Number = Annotated[float, Strict()]  # JSON numbers (integers too), finite (see allow_inf_nan)

MAX_NEW_TOKENS = 2**31 - 1  # the engine refuses anything beyond the context; this keeps ints sane
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # stop matching rescans the held-back tail per token: keep it short
TEMPERATURE_CAP = min(2.0, MAX_TEMPERATURE)  # OpenAI's range


class ApiError(Exception):
    """An error the client sees in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param=param,
                    code="unsupported_parameter")


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def _unicode(text: str) -> str:
    """Refuse lone surrogates (JSON "\\ud800" parses to one): the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid("text must be valid Unicode (a lone surrogate is not)") from None
    return text


def _neutral(value: object, neutral: object) -> bool:
    """`value` is absent or equals `neutral`, a boolean never standing in for a number."""
    return value is None or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are accepted and ignored, as OpenAI
    clients send extras (user, metadata, ...), except sampling fields we cannot honour."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: StrictStr
    max_tokens: Int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    stop: str | list[str] | None = None
    temperature: Number | None = Field(default=None, ge=0.0, le=TEMPERATURE_CAP)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    seed: Int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = Field(default=None, ge=1)
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model says
    speculative: StrictBool = True  # false: this request decodes plainly on a speculating server
    # llama-server's: false, and the request neither starts from a kept prefix nor is kept
    cache_prompt: StrictBool = True
    # Parsed (so their types and ranges are checked) but only their neutral values are served.
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: object) -> str | list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _invalid("must be a string or a list of strings")
        if len(items) > MAX_STOPS:
            raise _invalid(f"at most {MAX_STOPS} stop sequences")
        for s in items:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise _invalid(f"each stop sequence must have 1-{MAX_STOP_CHARS} characters")
            _unicode(s)
        return v  # type: ignore[return-value]  # checked above: a str or a list of str

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TEMPERATURE:  # 1/T would overflow: 0 is greedy
            raise _invalid(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    def top_count(self) -> int:
        """How many alternatives per token the client wants with their log-probabilities."""
        return 0

    def wants_logprobs(self) -> bool:
        return False

    def grammar_spec(self) -> tuple[Constrained, str] | None:
        """What the output is constrained to and the field that says so (None: free text);
        ApiError naming the field."""
        schema = response_format(self.response_format)
        return None if schema is None else (later(schema), "response_format")

    def refusals(self) -> None:
        """Raise ApiError for a valid value that this server cannot honour."""
        if self.n is not None and self.n > 1:
            raise unsupported("n", "more than one choice per request")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _neutral(getattr(self, name), 0):
                raise unsupported(name, "a non-zero penalty")
        if self.logit_bias:
            raise unsupported("logit_bias", "a non-empty logit bias")
        for name, neutral in _NEUTRAL_EXTRAS.items():
            if not _neutral((self.model_extra or {}).get(name), neutral):
                raise unsupported(name, f"a value other than {neutral!r}")


def later(schema: dict[str, Any]) -> Callable[[Grammars], Any]:
    """A JSON schema's constraint, built where it is called: on a compile thread (api/constrain.py),
    so that writing a large schema's text (9 ms for 234 KiB) does not hold the event loop."""
    return lambda grammars: grammars.constraint(GrammarSpec.json_schema(schema))


def response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's `response_format`: text, json_object (any JSON object; llama-server's `schema`
    key too) or json_schema ({"json_schema": {"name", "schema", "strict"}}), as the JSON schema
    the output follows (None: free text)."""
    where = "response_format"
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema(fmt.get("schema", {"type": "object"}), f"{where}.schema")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, f"{where}.json_schema: must be an object with a `schema`", param=f"{where}.json_schema")
        name = spec.get("name", "")
        if not isinstance(name, str) or len(name) > 64:
            raise ApiError(400, f"{where}.json_schema.name: must be a string of at most 64 characters",
                           param=f"{where}.json_schema.name")
        if not isinstance(spec.get("strict", False), bool):
            raise ApiError(400, f"{where}.json_schema.strict: must be a boolean", param=f"{where}.json_schema.strict")
        return _schema(spec.get("schema", {}), f"{where}.json_schema.schema")
    raise ApiError(400, f"{where}.type: must be one of 'text', 'json_object', 'json_schema', got {kind!r}"[:300],
                   param=f"{where}.type")


def _schema(schema: object, where: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where}: a JSON schema must be an object", param=where)
    return schema


# Sampling fields of OpenAI's legacy API and of vLLM that clients send: refused unless neutral.
_NEUTRAL_EXTRAS: dict[str, object] = {"best_of": 1, "echo": False, "suffix": "", "min_p": 0,
                                      "repetition_penalty": 1, "use_beam_search": False}


def _part_text(part: object) -> str:
    if not isinstance(part, dict):
        raise _invalid("each content part must be an object")
    if part.get("type") != "text":
        raise _invalid(f"content part of type {part.get('type')!r} is not supported (text only)")
    text = part.get("text")
    if not isinstance(text, str):
        raise _invalid("a text content part needs a string `text`")
    return text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None  # content parts are joined into one text when parsed
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: object) -> str | None:
        if v is None:
            return None
        if isinstance(v, str):
            return _unicode(v)
        if isinstance(v, list):
            return _unicode("".join(_part_text(p) for p in v))
        raise _invalid("must be a string or a list of text parts")

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise _invalid(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    function_call: Any = None
    # More variables for the chat template (vLLM's and llama-server's field): Qwen3's
    # enable_thinking, a system date... Scalars only, under names the template does not own.
    chat_template_kwargs: dict[str, Any] | None = None

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def top_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def refusals(self) -> None:
        super().refusals()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if self.functions:  # the deprecated form of tools
            raise unsupported("functions", "the deprecated `functions` (give `tools`)")
        if self.function_call not in (None, "none", "auto"):
            raise unsupported("function_call", "the deprecated `function_call` (give `tool_choice`)")
        _check_template_kwargs(self.chat_template_kwargs)


# What the template is given by the server itself: a request may not set these.
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                           "tools", "documents"})
MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_VALUE = 16, 4096


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    if not kwargs:
        return
    where = "chat_template_kwargs"
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ApiError(400, f"{where}: at most {MAX_TEMPLATE_KWARGS} variables, got {len(kwargs)}", param=where)
    for key, value in kwargs.items():
        if not (key.isidentifier() and key.isascii() and len(key) <= 64) or key.startswith("_"):
            raise ApiError(400, f"{where}: {key[:64]!r} is not a variable name", param=where)
        if key in _TEMPLATE_OWN:
            raise ApiError(400, f"{where}: {key!r} is set by the server, not the request", param=where)
        if not isinstance(value, bool | int | float | str) or (isinstance(value, float) and not math.isfinite(value)):
            raise ApiError(400, f"{where}: {key} must be a string, a number or a boolean", param=where)
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE:
            raise ApiError(400, f"{where}: {key} is longer than {MAX_TEMPLATE_VALUE} characters", param=where)


class CompletionRequest(Sampling):
    prompt: str | list[int]  # one text, or one prompt's token ids
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI allows 0-5
    # llama-server's: a JSON schema, or a GBNF grammar (llama.cpp's grammars/README.md) the text follows
    json_schema: dict[str, Any] | None = None
    grammar: StrictStr | None = None

    def grammar_spec(self) -> tuple[Constrained, str] | None:
        given = [n for n in ("response_format", "json_schema", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ApiError(400, f"{given[1]}: give one of response_format, json_schema and grammar, not several",
                           param=given[1])
        if self.json_schema is not None:
            return later(self.json_schema), "json_schema"
        if self.grammar is not None:
            return GrammarSpec("gbnf", self.grammar), "grammar"
        return super().grammar_spec()

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: object) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one prompt
        if isinstance(v, str):
            return _unicode(v)
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return _token_ids(v)
        if isinstance(v, list) and len(v) != 1 and all(isinstance(p, str | list) for p in v):
            raise _invalid("exactly one prompt per request is supported")
        raise _invalid("must be a string, a list of one string, or a list of token ids")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_count(self) -> int:
        return self.logprobs or 0


def _token_ids(ids: list[int]) -> list[int]:
    if any(t < 0 for t in ids):
        raise _invalid("token ids must be >= 0")
    return ids


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def now() -> int:
    return int(time.time())
