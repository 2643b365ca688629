"""One request's generation, seen from the event loop: engine events in, text pieces out.

The engine calls back from its own thread; events cross into the event loop through
`call_soon_threadsafe`. The engine detokenizes and checks stop sequences where it checks stop
tokens (serving/stops.py), so each event's text is exactly what the client may see. With
log-probabilities asked for, each piece also carries the entries of the tokens consumed since
the previous piece (text held back by the detokenizer or the stop matcher travels later, and
its tokens with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardline.api.logprobs import TokenLogprob
from shardline.api.metrics import ServerMetrics
from shardline.api.schemas import ApiError, Sampling
from shardline.config import SamplingConfig
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer, StreamDecoder
from shardline.serving.engine import Constraint, Event, Overloaded, Request, Serving

# How often a request waiting for its next token checks that the engine thread is still alive
# (an engine that died without a final event would otherwise leave the request hanging).
HEALTH_POLL_S = 1.0


@dataclass
class Piece:
    text: str
    finish: str | None = None  # "stop" | "length" on the last piece
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the token ids consumed since the previous piece


@dataclass
class Collected:
    text: str
    finish: str
    logprobs: list[TokenLogprob]


def engine_failed(engine: Serving) -> ApiError:
    return ApiError(503, f"the engine has failed: {engine.failed}", "server_error", code="engine_failed")


def check_alive(engine: Serving) -> None:
    if engine.failed:
        raise engine_failed(engine)


UNKNOWN_CONTEXT_MAX_TOKENS = 256  # a request's default when the app is not told the context


def fitted_max_tokens(default: int | None, context: int, prompt: int) -> int:
    """The max_tokens of a request that gives none: what is left of the `context` after its
    `prompt` tokens (as vLLM and llama-server do), at most the server's `default` if it sets one;
    at least 1, so that a prompt filling the context is refused by the engine as too long."""
    if context <= 0:
        return default or UNKNOWN_CONTEXT_MAX_TOKENS
    left = max(1, context - prompt)
    return left if default is None else min(default, left)


@dataclass
class Generation:
    engine: Serving
    tok: ChatTokenizer
    metrics: ServerMetrics
    endpoint: str
    prompt: list[int]
    body: Sampling
    default_max_tokens: int
    retry_after_s: int = 1
    key_scope: str = ""  # the API key's scope (auth.py): kept prefixes are shared within it alone
    constraint: Constraint | None = None  # its grammar's state, when its output is constrained
    constraint_param: str = ""  # the field it came from (response_format, grammar, tools...)
    completion_tokens: int = 0
    tokens: list[int] = field(default_factory=list)  # every token emitted (tool calls are read from them)
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None  # its latest token (the gap histogram's)

    def _request(self) -> Request:
        b = self.body
        try:
            cfg = SamplingConfig(max_tokens=b.limit(self.default_max_tokens), temperature=b.sampling_temperature(),
                                 top_k=b.top_k or 0, top_p=1.0 if b.top_p is None else b.top_p, seed=b.seed,
                                 logprobs=b.top_count())
        except ShardlineError as e:  # the schema's bounds are the config's, so this is a last guard
            raise ApiError(400, str(e)) from None
        tok = self.tok
        return Request(self.prompt, cfg, frozenset() if b.ignore_eos else frozenset(tok.stop_ids),
                       b.speculative, tuple(b.stops()), lambda: StreamDecoder(tok), scope=self.key_scope,
                       cache_prompt=b.cache_prompt, constraint=self.constraint)

    def start_engine(self) -> None:
        """Submit to the engine now, so that a refusal becomes an HTTP error before any byte
        of a streamed response is sent."""
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:  # called on the engine thread
            if loop.is_closed():  # the server has shut down: nobody is listening any more
                return
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                loop.call_soon_threadsafe(self._events.put_nowait, ev)

        request = self._request()
        check_alive(self.engine)
        try:
            self._ticket = self.engine.submit(request, deliver)
        except Overloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError(429, f"the server is overloaded, retry later: {e}", "server_error", code="overloaded",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except ShardlineError as e:
            if self.engine.failed:  # it died between the check and the submit
                raise engine_failed(self.engine) from None
            code = "context_length_exceeded" if "exceeds the context" in str(e) else None
            raise ApiError(400, str(e), param="messages" if code else None, code=code) from None
        self.metrics.prompt_tokens.inc(len(self.prompt))

    async def _next_event(self) -> Event:
        while True:
            try:
                return await asyncio.wait_for(self._events.get(), HEALTH_POLL_S)
            except TimeoutError:
                check_alive(self.engine)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces; the last one carries the finish reason. Leaving early (a stop sequence,
        a client that went away) cancels the stream in the engine and frees its KV."""
        visible = _Visible(self.body.wants_logprobs())
        finish = "cancelled"
        try:
            while True:
                ev = await self._next_event()
                if ev.token is None:
                    finish = ev.finish or "stop"
                    self._check_failure(ev)
                    yield visible.end(ev, finish)
                    return
                self.completion_tokens += 1
                self.tokens.append(ev.token)
                now = time.perf_counter()
                if self.last is not None:
                    self.metrics.gap.observe(now - self.last)
                self.first, self.last = self.first or now, now
                piece = visible.push(ev)
                if piece is not None:
                    yield piece
        finally:
            if finish in ("stop", "cancelled"):
                self.engine.cancel(self._ticket)  # a no-op for a stream the engine already finished
            self.metrics.observe(self.endpoint, finish, self.start, self.first, time.perf_counter(),
                                 self.completion_tokens)

    def _check_failure(self, ev: Event) -> None:
        """An error event as the client's error: its own grammar's failure a 400 naming the field
        it sent (the message is built from this request alone), the server's a 500."""
        if ev.finish != "error":
            return
        check_alive(self.engine)  # a dead engine is a 503, not this request's failure
        if ev.cause == "constraint":
            param = self.constraint_param or "response_format"
            raise ApiError(400, f"{param}: the output cannot follow this grammar: {ev.error}", param=param,
                           code="grammar_failed")
        raise ApiError(500, f"generation failed: {ev.error}", "server_error")

    async def collect(self) -> Collected:
        """The whole text, its finish reason and every token's entry (non-streaming responses)."""
        parts, finish, logprobs = [], "stop", []
        async for p in self.pieces():
            parts.append(p.text)
            logprobs.extend(p.logprobs)
            finish = p.finish or finish
        return Collected("".join(parts), finish, logprobs)


class _Visible:
    """Events -> pieces: each carries the text its events let through and, with logprobs asked
    for, the entries of the tokens consumed since the previous piece; tokens wholly inside a
    cut-off stop sequence are not shown."""

    def __init__(self, keep: bool) -> None:
        self._keep = keep
        self._shown = 0  # characters sent
        self._pending: list[TokenLogprob] = []
        self._ids: list[int] = []

    def push(self, ev: Event) -> Piece | None:
        """The piece to send after this token's event, if any."""
        assert ev.token is not None
        self._ids.append(ev.token)
        if self._keep:
            self._pending.append(TokenLogprob(ev.token, ev.logprob, ev.top, ev.offset))
        self._shown += len(ev.text)
        if ev.cut:
            return Piece(ev.text, None, [e for e in self._take() if e.offset < self._shown], self._tokens())
        return Piece(ev.text, None, self._take(), self._tokens()) if ev.text else None

    def end(self, ev: Event, finish: str) -> Piece:
        return Piece(ev.text, finish, self._take(), self._tokens())

    def _take(self) -> list[TokenLogprob]:
        taken, self._pending = self._pending, []
        return taken

    def _tokens(self) -> list[int]:
        taken, self._ids = self._ids, []
        return taken
