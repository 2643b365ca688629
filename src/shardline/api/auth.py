"""An optional API key, as OpenAI clients send it (`Authorization: Bearer KEY`), checked before
anything of the request is read: a request to /v1/... without the key gets 401 in OpenAI's error
format. /health and /metrics stay open (load balancers and scrapers probe them without keys).

The comparison takes the same time wherever the keys differ (hmac.compare_digest). A refused
body is read and dropped first, within limits.py's bounds, so the client sees the 401 rather
than a reset connection."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from shardline.api.limits import _discard, _header
from shardline.errors import ShardlineError

PROTECTED = "/v1/"
MIN_KEY_CHARS = 8


def load_key(key: str | None, key_file: Path | None) -> str | None:
    """--api-key or --api-key-file (its first line), checked; None when neither is given."""
    if key is not None and key_file is not None:
        raise ShardlineError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = key_file.read_text().splitlines()[0] if key_file.stat().st_size else ""
        except (OSError, UnicodeDecodeError) as e:
            raise ShardlineError(f"--api-key-file {key_file}: {e}") from None
    if key is None:
        return None
    key = key.strip()
    if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise ShardlineError(f"the API key must be at least {MIN_KEY_CHARS} printable ASCII characters")
    return key


def _unauthorized(why: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    error = {"message": why, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"www-authenticate", b"Bearer"), (b"connection", b"close")]


class ApiKey:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        why = ("missing API key: send it as 'Authorization: Bearer KEY'" if given is None
               else "incorrect API key provided")
        await _discard(receive)
        body, headers = _unauthorized(why)
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
