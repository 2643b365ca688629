"""OpenAI request and response shapes. OpenAI's types stop here: the engine sees a `Request`."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An error the client sees in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are accepted and ignored, as OpenAI
    clients send extras (user, metadata, ...)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text of the message; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise ApiError(400, f"content part of type {p.get('type')!r} is not supported", param="messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str | list[str]
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "exactly one prompt per request is supported", param="prompt")
        return self.prompt[0]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def now() -> int:
    return int(time.time())
