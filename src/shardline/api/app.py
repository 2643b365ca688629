"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models,
/health and /metrics; and the pages for people (api/pages.py: the chat at /, the fleet at
/fleet). Errors use OpenAI's JSON error format, whatever their source: a bad field, an
oversized body, a prompt the template or the tokenizer cannot take, a full server or an
engine that has stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from shardline.api.auth import SCOPE, ApiKey
from shardline.api.availability import when_up
from shardline.api.bounded import parsed
from shardline.api.constrain import Compiles, constrain
from shardline.api.generation import Generation, Piece, check_alive, fitted_max_tokens
from shardline.api.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from shardline.api.logprobs import ChatLogprobs, LegacyLogprobs, TokenLogprob, TokenText
from shardline.api.metrics import ServerMetrics
from shardline.api.pages import add_pages
from shardline.api.prompt import tokenize
from shardline.api.schemas import ApiError, ChatRequest, CompletionRequest, Sampling, now, usage
from shardline.api.tools import ToolPlan, ToolStream, offered, openai_calls, template_messages, tool_plan
from shardline.model.grammar import Grammars
from shardline.model.tokenizer import ChatTokenizer
from shardline.serving.engine import Serving
from shardline.serving.status import health as serving_health
from shardline.serving.status import placements

log = logging.getLogger("shardline.api")
T = TypeVar("T")
Formatter = Callable[[list[TokenLogprob]], dict[str, Any]]


@dataclass(frozen=True)
class Served:
    engine: Serving
    tok: ChatTokenizer
    model_id: str
    default_max_tokens: int | None = None  # a request's without max_tokens; None: what is left of the context
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    retry_after_s: int = 1  # Retry-After of a 429 when every stream and queue slot is taken
    api_keys: tuple[str, ...] = ()  # one of them required of /v1 requests when any (api/auth.py)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (none: CORS off)
    precision: str = "exact"  # the run precision of this process's stages (the fleet page shows it)
    context: int = 0  # the longest sequence served (0: unknown)
    kv: str = "f32"  # this process's KV cache precision ("device default" where the device chose)
    reconnect_s: float = 10.0  # how long a request waits for a broken chain's repair before a 503
    grammars: Grammars | None = None  # constrained decoding (response_format, json_schema, grammar); None: refused


class Json(JSONResponse):
    """JSON with non-ASCII escaped, so that text echoed from a request (a lone surrogate in a
    model name) cannot fail to encode; NaN and infinities are refused, as JSON has none."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


def build_app(served: Served) -> FastAPI:
    compiles = Compiles(retry_after_s=served.retry_after_s)  # grammars compiled off the event loop, a few at a time

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        compiles.close()

    app = FastAPI(title="shardline", docs_url=None, redoc_url=None, default_response_class=Json, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=served.max_body_bytes)
    if served.api_keys:
        app.add_middleware(ApiKey, keys=served.api_keys)  # added after: runs before, before the body is read
    if served.cors_origins:  # outermost: a browser's preflight carries no key, and gets its answer here
        app.add_middleware(CORSMiddleware, allow_origins=list(served.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    metrics = ServerMetrics(served.engine)
    token_text = TokenText(served.tok)
    _errors(app)
    add_pages(app, served, Json)

    async def generation(endpoint: str, prompt: list[int], body: Sampling, request: Request,
                         tools: ToolPlan | None = None) -> Generation:
        key_scope = getattr(request.state, SCOPE, "")  # whose kept prefixes it may share (auth.py)
        default = fitted_max_tokens(served.default_max_tokens, served.context, len(prompt))
        wanted = (tools.constraint, "tools") if tools else body.grammar_spec()
        constraint = await constrain(served.grammars, compiles, wanted, metrics)
        return Generation(served.engine, served.tok, metrics, endpoint, prompt, body, default,
                          served.retry_after_s, key_scope=key_scope, constraint=constraint,
                          constraint_param=wanted[1] if wanted else "")

    @app.get("/health")
    async def health() -> Response:
        """200 while requests can be served, else 503 with the reason; each stage's state."""
        e = served.engine
        now = serving_health(placements(e), e.failed, e.stalled)
        state = {"model": served.model_id, "active_streams": e.active, "waiting": e.waiting,
                 "context": served.context, "kv_cache": served.kv, "stages": now.stages}
        if not now.ok:
            return Json({"status": "unhealthy", "error": now.reason, **state}, status_code=503)
        return Json({"status": "ok", **state})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                            "owned_by": "shardline"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await parsed(request, ChatRequest)
        _admit(served, body)
        plan = tool_plan(body, served.tok)
        messages = template_messages(body)
        prompt = await tokenize(partial(ChatTokenizer.encode_chat, extra=body.chat_template_kwargs,
                                        tools=offered(plan.tools) if plan else None), served.tok, messages, "messages")
        shape = _ChatShape(served.model_id, ChatLogprobs(token_text) if body.wants_logprobs() else None,
                           ToolStream(plan, served.tok) if plan else None)
        await when_up(served.engine, served.reconnect_s)
        return await _respond(await generation("chat", prompt, body, request, plan), body, request, shape)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await parsed(request, CompletionRequest)
        _admit(served, body)
        if isinstance(body.prompt, str):
            prompt, prompt_text = await tokenize(ChatTokenizer.encode, served.tok, body.prompt, "prompt"), body.prompt
        else:
            prompt = _known_ids(body.prompt, served.tok.vocab_size)
            prompt_text = await run_in_threadpool(served.tok.decode, prompt) if body.wants_logprobs() else ""
        fmt = LegacyLogprobs(token_text, len(prompt_text)) if body.wants_logprobs() else None
        await when_up(served.engine, served.reconnect_s)
        return await _respond(await generation("completion", prompt, body, request), body, request,
                              _TextShape(served.model_id, fmt))

    return app


def _admit(served: Served, body: Sampling) -> None:
    """Refuse before any work: another model, a setting we cannot honour, a dead engine."""
    if body.model != served.model_id:
        raise ApiError(404, f"The model `{body.model[:100]}` does not exist. This server serves "
                            f"`{served.model_id}`.", param="model", code="model_not_found")
    body.refusals()
    check_alive(served.engine)


def _known_ids(ids: list[int], vocab: int) -> list[int]:
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token id {bad} is not in the vocabulary (0-{vocab - 1})", param="prompt")
    return ids


class _ChatShape:
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, logprobs: Formatter | None = None, tools: ToolStream | None = None) -> None:
        self.model, self.id, self.logprobs = model, f"chatcmpl-{secrets.token_hex(12)}", logprobs
        self.tools = tools

    def _lp(self, entries: list[TokenLogprob], always: bool) -> dict[str, Any] | None:
        """A whole answer always has a logprobs object when asked for; a chunk only with tokens."""
        return self.logprobs(entries) if self.logprobs and (always or entries) else None

    def choice(self, text: str, finish: str, entries: list[TokenLogprob], tokens: list[int]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            parsed = self.tools.plan.syntax.parse(self.tools.tok.raw.decode(tokens, skip_special_tokens=False))
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content or None,
                           "tool_calls": openai_calls(parsed.calls)}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": 0, "message": message, "logprobs": self._lp(entries, True), "finish_reason": finish}

    def deltas(self, p: Piece, first: bool, tokens: list[int]) -> list[dict[str, Any]]:
        """The chunks' choices for piece `p` (`tokens`: every token so far, read at the end for calls)."""
        if self.tools is None:
            return [self.delta(p.text, p.finish, p.logprobs, first)] if (p.text or first or p.finish or p.logprobs) \
                else []
        text = self.tools.push(p.text, p.tokens)
        if not p.finish:
            return [self.delta(text, None, p.logprobs, first)] if (text or first or p.logprobs) else []
        rest, parsed = self.tools.end(tokens)
        if not parsed.calls:
            return [self.delta(text + rest, p.finish, p.logprobs, first)]
        out = [self.delta(text + rest, None, p.logprobs, first)] if (text + rest or first) else []
        calls = [{"index": i, **c} for i, c in enumerate(openai_calls(parsed.calls))]
        out.append({"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
        out.append(self.delta(None, "tool_calls" if p.finish == "stop" else p.finish, [], False))
        return out

    def delta(self, text: str | None, finish: str | None, entries: list[TokenLogprob],
              first: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            d["content"] = text
        return {"index": 0, "delta": d, "logprobs": self._lp(entries, False), "finish_reason": finish}


class _TextShape(_ChatShape):
    obj, chunk_obj = "text_completion", "text_completion"

    def __init__(self, model: str, logprobs: Formatter | None = None) -> None:
        super().__init__(model, logprobs)
        self.id = f"cmpl-{secrets.token_hex(12)}"

    def choice(self, text: str, finish: str, entries: list[TokenLogprob], tokens: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._lp(entries, True), "finish_reason": finish}

    def delta(self, text: str | None, finish: str | None, entries: list[TokenLogprob],
              first: bool = False) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": self._lp(entries, False), "finish_reason": finish}


async def _respond(gen: Generation, body: Sampling, request: Request, shape: _ChatShape) -> Response:
    gen.start_engine()  # refusals (too long, overloaded) become errors before any byte is sent
    if body.stream:
        return StreamingResponse(_sse(gen, body, shape), media_type="text/event-stream")
    done = await _unless_disconnected(gen.collect(), request)
    return Json({"id": shape.id, "object": shape.obj, "created": now(), "model": shape.model,
                 "choices": [shape.choice(done.text, done.finish, done.logprobs, gen.tokens)],
                 "usage": usage(len(gen.prompt), gen.completion_tokens)})


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T:
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
            for choice in shape.deltas(p, first, gen.tokens):
                yield event([choice])
                first = False
    except ApiError as e:  # headers are gone: the error travels as an event
        yield f"data: {json.dumps(e.body())}\n\n"
    except Exception as e:  # a bug ends this stream with an error event, not silently
        log.exception("stream failed")
        yield f"data: {json.dumps(ApiError(500, f'internal error: {type(e).__name__}', 'server_error').body())}\n\n"
    if body.include_usage():
        yield event([], usage=usage(len(gen.prompt), gen.completion_tokens))
    yield "data: [DONE]\n\n"


def _param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic location as OpenAI names a parameter: ("body", "messages", 0, "role") ->
    "messages[0].role"."""
    out = ""
    for x in loc[1:] if loc[:1] == ("body",) else loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or None


def _errors(app: FastAPI) -> None:
    def handler(kind: type[Exception]) -> Callable[[Callable[..., Any]], Any]:
        return app.exception_handler(kind)

    @handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        return Json(e.body(), status_code=e.status, headers=e.headers)

    @handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}  # a body's are raised by api/bounded.parsed
        where = _param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid request"))
        return Json(ApiError(400, f"{where or 'body'}: {msg}", param=where).body(), status_code=400)

    @handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return Json(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code,
                    headers=e.headers)

    @handler(Exception)
    async def crashed(_: Request, e: Exception) -> Response:
        error = ApiError(500, f"internal error: {type(e).__name__}", "server_error")
        return Json(error.body(), status_code=500)
