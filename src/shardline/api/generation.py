"""One request's generation, seen from the event loop: engine events in, text pieces out.

The engine calls back from its own thread; events cross into the event loop through
`call_soon_threadsafe`. Text goes through the streaming detokenizer and the stop matcher, so
what comes out is exactly what the client may see.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardline.api.metrics import ServerMetrics
from shardline.api.schemas import ApiError, Sampling
from shardline.config import SamplingConfig
from shardline.errors import ShardlineError
from shardline.model.tokenizer import ChatTokenizer, StreamDecoder
from shardline.serving.engine import Engine, Event, Overloaded, Request
from shardline.serving.stops import StopMatcher


@dataclass
class Piece:
    text: str
    finish: str | None = None  # "stop" | "length" on the last piece


@dataclass
class Generation:
    engine: Engine
    tok: ChatTokenizer
    metrics: ServerMetrics
    endpoint: str
    prompt: list[int]
    body: Sampling
    default_max_tokens: int
    completion_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None

    def _request(self) -> Request:
        try:
            cfg = SamplingConfig(max_tokens=self.body.limit(self.default_max_tokens),
                                 temperature=self.body.temperature, top_k=self.body.top_k,
                                 top_p=self.body.top_p, seed=self.body.seed)
        except ShardlineError as e:
            raise ApiError(400, str(e)) from None
        return Request(self.prompt, cfg, frozenset() if self.body.ignore_eos else frozenset(self.tok.stop_ids))

    def start_engine(self) -> None:
        """Submit to the engine now, so that a refusal becomes an HTTP error before any byte
        of a streamed response is sent."""
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(self._events.put_nowait, ev)

        try:
            self._ticket = self.engine.submit(self._request(), deliver)
        except Overloaded as e:
            raise ApiError(503, f"the server is overloaded: {e}", "server_error", code="overloaded") from None
        except ShardlineError as e:
            code = "context_length_exceeded" if "exceeds the context" in str(e) else None
            raise ApiError(400, str(e), param="messages" if code else None, code=code) from None
        self.metrics.prompt_tokens.inc(len(self.prompt))

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces; the last one carries the finish reason. Leaving early (a stop sequence,
        a client that went away) cancels the stream in the engine and frees its KV."""
        text, stops = StreamDecoder(self.tok), StopMatcher(self.body.stops())
        finish = "cancelled"
        try:
            while True:
                ev = await self._events.get()
                if ev.token is None:
                    finish = ev.finish or "stop"
                    if finish == "error":
                        raise ApiError(500, f"generation failed: {ev.error}", "server_error")
                    yield Piece(stops.flush(), finish)
                    return
                self.completion_tokens += 1
                self.first = self.first or time.perf_counter()
                delta = stops.push(text.push(ev.token))
                if stops.stopped:
                    finish = "stop"
                    yield Piece(delta, finish)
                    return
                if delta:
                    yield Piece(delta)
        finally:
            if finish in ("stop", "cancelled"):
                self.engine.cancel(self._ticket)  # a no-op for a stream the engine already finished
            self.metrics.observe(self.endpoint, finish, self.start, self.first, time.perf_counter(),
                                 self.completion_tokens)

    async def collect(self) -> tuple[str, str]:
        """The whole text and its finish reason (non-streaming responses)."""
        parts, finish = [], "stop"
        async for p in self.pieces():
            parts.append(p.text)
            finish = p.finish or finish
        return "".join(parts), finish
