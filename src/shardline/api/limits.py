"""A request body size limit, as ASGI middleware: a body over the limit is answered with 413
(OpenAI's error format) as soon as it is known to be too large, from its declared
Content-Length or, for a chunked body, after reading at most the limit (plus one chunk). No
more than the limit is ever kept in memory.

Most clients send the whole body before they read the answer. Closing the connection on them
with their bytes unread makes the kernel reset it, and the client sees a broken connection
instead of the 413. So the rest of a refused body is read and thrown away first, for a bounded
time and number of bytes; a client that waits for `100 Continue` is answered at once.

An accepted body is read here, before the app runs, and handed on in one message; later
receives go to the server as usual, so the app still learns when the client goes away."""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 2 * 2**20
DISCARD_BYTES = 64 * 2**20  # of a refused body, read and dropped so the client gets the 413
DISCARD_S = 2.0


def _too_large(limit: int) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    error = {"message": f"the request body is larger than the limit of {limit} bytes",
             "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    # The rest of the body is never read, so the connection cannot carry another request.
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    return body, headers


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _declared_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # the server itself refuses a malformed Content-Length


async def _discard(receive: Receive) -> None:
    """Read and drop what the client is still sending, within DISCARD_BYTES and DISCARD_S."""
    left = DISCARD_BYTES
    try:
        async with asyncio.timeout(DISCARD_S):
            while left > 0:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                left -= len(message.get("body", b""))
    except TimeoutError:
        return


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            if _header(scope, b"expect") != b"100-continue":  # else it sends nothing until told to
                await _discard(receive)
            return await self._refuse(send)
        body = await self._read(receive)
        if body is None:
            await _discard(receive)
            return await self._refuse(send)
        await self.app(scope, _Replay(body, receive), send)

    async def _read(self, receive: Receive) -> Message | None:
        """The whole body as one message (a disconnect as itself); None once over the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, send: Send) -> None:
        body, headers = _too_large(self.max_bytes)
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _Replay:
    """A receive callable that first gives the body already read, then defers to the server."""

    def __init__(self, first: Message, receive: Receive) -> None:
        self._first: Message | None = first
        self._receive = receive

    async def __call__(self) -> Message:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._receive()
