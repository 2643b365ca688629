"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models,
/health and /metrics. Errors use OpenAI's JSON error format."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from shardline.api.generation import Generation
from shardline.api.metrics import ServerMetrics
from shardline.api.schemas import ApiError, ChatRequest, CompletionRequest, Sampling, now, usage
from shardline.model.tokenizer import ChatTokenizer
from shardline.serving.engine import Engine


@dataclass(frozen=True)
class Served:
    engine: Engine
    tok: ChatTokenizer
    model_id: str
    default_max_tokens: int = 256


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="shardline", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(served.engine)
    _errors(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        e = served.engine
        return {"status": "ok", "model": served.model_id, "active_streams": e.active, "waiting": e.waiting}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                            "owned_by": "shardline"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_model(served, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        gen = Generation(served.engine, served.tok, metrics, "chat", served.tok.encode_chat(messages), body,
                         served.default_max_tokens)
        return await _respond(gen, body, request, _ChatShape(served.model_id))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(served, body)
        gen = Generation(served.engine, served.tok, metrics, "completion", served.tok.encode(body.text()), body,
                         served.default_max_tokens)
        return await _respond(gen, body, request, _TextShape(served.model_id))

    return app


def _check_model(served: Served, body: Sampling) -> None:
    if body.model != served.model_id:
        raise ApiError(404, f"The model `{body.model}` does not exist. This server serves `{served.model_id}`.",
                       param="model", code="model_not_found")


class _ChatShape:
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str) -> None:
        self.model, self.id = model, f"chatcmpl-{secrets.token_hex(12)}"

    def choice(self, text: str, finish: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def delta(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            d["content"] = text
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}


class _TextShape(_ChatShape):
    obj, chunk_obj = "text_completion", "text_completion"

    def __init__(self, model: str) -> None:
        self.model, self.id = model, f"cmpl-{secrets.token_hex(12)}"

    def choice(self, text: str, finish: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        return self.choice(text or "", finish)  # type: ignore[arg-type]


async def _respond(gen: Generation, body: Sampling, request: Request, shape: _ChatShape) -> Response:
    gen.start_engine()  # refusals (too long, overloaded) become errors before any byte is sent
    if body.stream:
        return StreamingResponse(_sse(gen, body, shape), media_type="text/event-stream")
    text, finish = await _unless_disconnected(gen.collect(), request)
    return JSONResponse({"id": shape.id, "object": shape.obj, "created": now(), "model": shape.model,
                         "choices": [shape.choice(text, finish)],
                         "usage": usage(len(gen.prompt), gen.completion_tokens)})


async def _unless_disconnected(work: Awaitable[tuple[str, str]], request: Request) -> tuple[str, str]:
    """Await `work`, cancelling it (and so the stream) if the client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ApiError(499, "client closed the request")


async def _sse(gen: Generation, body: Sampling, shape: _ChatShape) -> AsyncIterator[str]:
    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {"id": shape.id, "object": shape.chunk_obj, "created": now(), "model": shape.model,
                 "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    first = True
    try:
        async for p in gen.pieces():
            if p.text or first or p.finish:
                yield event([shape.delta(p.text, p.finish, first)])
                first = False
    except ApiError as e:  # headers are gone: the error travels as an event
        yield f"data: {json.dumps(e.body())}\n\n"
    if body.include_usage():
        yield event([], usage=usage(len(gen.prompt), gen.completion_tokens))
    yield "data: [DONE]\n\n"


def _errors(app: FastAPI) -> None:
    def handler(kind: type[Exception]) -> Callable[[Callable[..., Any]], Any]:
        return app.exception_handler(kind)

    @handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request"))
        return JSONResponse(ApiError(400, msg, param=where or None).body(), status_code=400)

    @handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)
