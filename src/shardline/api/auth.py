"""Optional API keys, as OpenAI clients send them (`Authorization: Bearer KEY`), checked before
anything of the request is read: a request to /v1/... without a key gets 401 in OpenAI's error
format. /health and /metrics stay open (load balancers and scrapers probe them without keys).
With several keys (`--api-key-file`, one per line), each key is its own scope: the request
carries its key's scope id (not the key) in `scope["state"]`, and kept prompt prefixes are never
shared between scopes (serving/prefix.py).

The comparison takes the same time wherever the keys differ (hmac.compare_digest). A refused
body is read and dropped first, within limits.py's bounds, so the client sees the 401 rather
than a reset connection."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from shardline.api.limits import _discard, _header
from shardline.errors import ShardlineError

PROTECTED = "/v1/"
MIN_KEY_CHARS = 8


MAX_KEYS = 1024
SCOPE = "key_scope"  # where a request's key scope id is put in the ASGI scope's state


def load_keys(key: str | None, key_file: Path | None) -> tuple[str, ...]:
    """--api-key, or --api-key-file's keys (one per line, blank lines skipped), checked; () when
    neither is given."""
    if key is not None and key_file is not None:
        raise ShardlineError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            keys = [k.strip() for k in key_file.read_text().splitlines() if k.strip()] or [""]
        except (OSError, UnicodeDecodeError) as e:
            raise ShardlineError(f"--api-key-file {key_file}: {e}") from None
    elif key is not None:
        keys = [key.strip()]
    else:
        return ()
    if len(keys) > MAX_KEYS:
        raise ShardlineError(f"--api-key-file holds {len(keys)} keys; at most {MAX_KEYS}")
    for k in keys:
        if len(k) < MIN_KEY_CHARS or not k.isascii() or not k.isprintable():
            raise ShardlineError(f"the API key must be at least {MIN_KEY_CHARS} printable ASCII characters")
    return tuple(dict.fromkeys(keys))


def scope_id(key: str) -> str:
    """A key's scope as the engine knows it: not the key itself (it may be logged or shown)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _unauthorized(why: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    error = {"message": why, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"www-authenticate", b"Bearer"), (b"connection", b"close")]


class ApiKey:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._expected = [(f"Bearer {k}".encode(), scope_id(k)) for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        # every key compared, whichever matches: the time taken does not say which or how far
        matches = [sid for expected, sid in self._expected if hmac.compare_digest(given or b"", expected)]
        if given is not None and matches:
            scope.setdefault("state", {})[SCOPE] = matches[0]
            return await self.app(scope, receive, send)
        why = ("missing API key: send it as 'Authorization: Bearer KEY'" if given is None
               else "incorrect API key provided")
        await _discard(receive)
        body, headers = _unauthorized(why)
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
