"""Nothing a client sends stops the server: every field range-checked (a hostile value gets an
OpenAI 400 naming it), bodies over the size limit get 413 (declared or chunked), a full server
answers 429 with Retry-After, a failed engine makes /health and new requests 503, and chat
templates or tokenizers that fail on the input give 400. A real `shardline serve` process where
the wire matters; the app in-process (with a real engine) where the engine must be tampered with."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from shardline.api.app import Served, build_app
from shardline.api.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from shardline.config import RunConfig
from shardline.host import trim_memory_every
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.serving.admission import Limits
from shardline.serving.engine import Engine
from tests.serving.test_api import MODEL, Server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4, "temperature": 0}
TEXT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
UNSUPPORTED = "unsupported_parameter"
DEEP: Any = {"a": [1]}  # 130 levels of objects and arrays: over the limit of 64 (api/bounded.py)
for _ in range(64):
    DEEP = {"a": [DEEP]}
TOO_DEEP = "nested deeper than 64 levels"
DEEP_ARGS = '{"a": ' * 2000 + "1" + "}" * 2000  # issue 54's audit item 4: a RecursionError, then a 500


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2")
    yield s
    s.stop()


def _post(server: Server, path: str, body: object, **kw: Any) -> httpx.Response:
    # json.dumps writes NaN and Infinity as Python's json reads them: what a hostile client sends
    return httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"}, **kw)


# (field, value, param named in the error, a piece of the message or the error code)
CHAT_CASES: list[tuple[str, object, str | None, str]] = [
    ("seed", -1, "seed", "greater than or equal to 0"),
    ("seed", 2**63, "seed", "less than or equal to 9223372036854775807"),
    ("seed", 1e30, "seed", "valid integer"),
    ("seed", "abc", "seed", "valid integer"),
    ("seed", True, "seed", "valid integer"),
    ("seed", 1.5, "seed", "valid integer"),
    ("temperature", -0.5, "temperature", "greater than or equal to 0"),
    ("temperature", math.nan, "temperature", "finite number"),
    ("temperature", math.inf, "temperature", "finite number"),
    ("temperature", -math.inf, "temperature", "finite number"),
    ("temperature", 2.5, "temperature", "less than or equal to 2"),
    ("temperature", 1e-308, "temperature", "must be 0 (greedy) or at least 0.001"),
    ("temperature", 5e-4, "temperature", "must be 0 (greedy) or at least 0.001"),
    ("temperature", "0.5", "temperature", "valid number"),
    ("temperature", True, "temperature", "valid number"),
    ("top_p", 0, "top_p", "greater than 0"),
    ("top_p", 1.5, "top_p", "less than or equal to 1"),
    ("top_p", math.nan, "top_p", "finite number"),
    ("top_p", -1, "top_p", "greater than 0"),
    ("top_k", -1, "top_k", "greater than or equal to 0"),
    ("top_k", 2**40, "top_k", "less than or equal to"),
    ("top_k", 2.0, "top_k", "valid integer"),
    ("top_k", True, "top_k", "valid integer"),
    ("max_tokens", 0, "max_tokens", "greater than or equal to 1"),
    ("max_tokens", -5, "max_tokens", "greater than or equal to 1"),
    ("max_tokens", 2**31, "max_tokens", "less than or equal to"),
    ("max_tokens", 10**400, "max_tokens", "less than or equal to"),
    ("max_tokens", 1.5, "max_tokens", "valid integer"),
    ("max_tokens", "10", "max_tokens", "valid integer"),
    ("max_tokens", True, "max_tokens", "valid integer"),
    ("max_completion_tokens", 0, "max_completion_tokens", "greater than or equal to 1"),
    ("n", 2, "n", UNSUPPORTED),
    ("n", 0, "n", "greater than or equal to 1"),
    ("n", True, "n", "valid integer"),
    ("stop", ["a", "b", "c", "d", "e"], "stop", "at most 4 stop sequences"),
    ("stop", "", "stop", "1-256 characters"),
    ("stop", ["ok", ""], "stop", "1-256 characters"),
    ("stop", "x" * 257, "stop", "1-256 characters"),
    ("stop", [1], "stop", "a string or a list of strings"),
    ("stop", 5, "stop", "a string or a list of strings"),
    ("stop", {"a": 1}, "stop", "a string or a list of strings"),
    ("stop", "\ud800", "stop", "valid Unicode"),
    ("logprobs", "yes", "logprobs", "valid boolean"),
    ("logprobs", 1, "logprobs", "valid boolean"),
    ("top_logprobs", 21, "top_logprobs", "less than or equal to 20"),
    ("top_logprobs", -1, "top_logprobs", "greater than or equal to 0"),
    ("top_logprobs", 2, "top_logprobs", "requires logprobs to be true"),
    ("presence_penalty", 3, "presence_penalty", "less than or equal to 2"),
    ("presence_penalty", 0.5, "presence_penalty", UNSUPPORTED),
    ("presence_penalty", math.nan, "presence_penalty", "finite number"),
    ("frequency_penalty", -3, "frequency_penalty", "greater than or equal to -2"),
    ("frequency_penalty", 1, "frequency_penalty", UNSUPPORTED),
    ("logit_bias", {"50": 10}, "logit_bias", UNSUPPORTED),
    ("logit_bias", {"50": 1000}, "logit_bias.50", "less than or equal to 100"),
    ("logit_bias", [1], "logit_bias", "valid dictionary"),
    ("response_format", {"type": "xml"}, "response_format.type", "must be one of"),
    ("tools", [TOOL], "tools", "renders no tools"),  # SmolLM2's own template (api/tools.py)
    ("functions", [TOOL["function"]], "functions", UNSUPPORTED),
    ("tool_choice", "required", "tool_choice", "needs tools"),
    ("chat_template_kwargs", {"messages": "x"}, "chat_template_kwargs", "'messages' is set by the server"),
    ("chat_template_kwargs", {"bos_token": "<s>"}, "chat_template_kwargs", "set by the server, not the request"),
    ("chat_template_kwargs", {"a b": 1}, "chat_template_kwargs", "'a b' is not a variable name"),
    ("chat_template_kwargs", {"__class__": 1}, "chat_template_kwargs", "is not a variable name"),
    ("chat_template_kwargs", {f"k{i}": 1 for i in range(17)}, "chat_template_kwargs", "at most 16 variables"),
    ("chat_template_kwargs", {"x": "y" * 5000}, "chat_template_kwargs", "longer than 4096 characters"),
    ("chat_template_kwargs", {"x": [1]}, "chat_template_kwargs", "x must be a string, a number or a boolean"),
    ("chat_template_kwargs", {"x": None}, "chat_template_kwargs", "x must be a string, a number or a boolean"),
    ("chat_template_kwargs", {"x": math.nan}, "chat_template_kwargs", "x must be a string, a number or a boolean"),
    ("chat_template_kwargs", "yes", "chat_template_kwargs", "valid dictionary"),
    ("stream", "yes", "stream", "valid boolean"),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage", "valid boolean"),
    ("ignore_eos", "yes", "ignore_eos", "valid boolean"),
    ("speculative", "no", "speculative", "valid boolean"),
    ("speculative", 0, "speculative", "valid boolean"),
    ("min_p", 0.1, "min_p", UNSUPPORTED),
    ("model", 5, "model", "valid string"),
    ("messages", [], "messages", "at least 1 item"),
    ("messages", "hi", "messages", "valid list"),
    ("messages", ["hi"], "messages[0]", "valid dictionary"),
    ("messages", [{"role": "bob", "content": "x"}], "messages[0].role", "'system', 'user'"),
    ("messages", [{"role": "user"}], "messages[0]", "a user message needs content"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content", "a string or a list of text parts"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content", "content part of type 'image_url' is not supported"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content",
     "needs a string `text`"),
    ("messages", [{"role": "user", "content": "\ud800"}], "messages[0].content", "valid Unicode"),
    ("messages", [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}],
     "messages[0].tool_calls[0]", "must be"),
    # Every JSON a client sends is parsed with bounded depth (issue 54): the field is named.
    ("messages", [{"role": "user", "content": "x", "metadata": DEEP}], "messages", TOO_DEEP),
    ("messages", [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGS}}]}],
     "messages[1].tool_calls[0].function.arguments", TOO_DEEP),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}, "response_format",
     TOO_DEEP),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": DEEP}}], "tools", TOO_DEEP),
    ("chat_template_kwargs", {"x": DEEP}, "chat_template_kwargs", TOO_DEEP),
    ("user", DEEP, "user", TOO_DEEP),
]

TEXT_CASES: list[tuple[str, object, str | None, str]] = [
    ("prompt", ["a", "b"], "prompt", "exactly one prompt per request is supported"),
    ("prompt", [], "prompt", "exactly one prompt per request is supported"),
    ("prompt", [[1], [2]], "prompt", "exactly one prompt per request is supported"),
    ("prompt", 5, "prompt", "a string, a list of one string, or a list of token ids"),
    ("prompt", None, "prompt", "a string, a list of one string, or a list of token ids"),
    ("prompt", [1, -2], "prompt", "token ids must be >= 0"),
    ("prompt", [True], "prompt", "a string, a list of one string, or a list of token ids"),
    ("prompt", [99_999_999], "prompt", "token id 99999999 is not in the vocabulary"),
    ("prompt", ["\ud800"], "prompt", "valid Unicode"),
    ("logprobs", True, "logprobs", "valid integer"),
    ("logprobs", 21, "logprobs", "less than or equal to 20"),
    ("logprobs", -1, "logprobs", "greater than or equal to 0"),
    ("best_of", 2, "best_of", UNSUPPORTED),
    ("echo", True, "echo", UNSUPPORTED),
    ("suffix", "x", "suffix", UNSUPPORTED),
    ("seed", True, "seed", "valid integer"),
    ("json_schema", DEEP, "json_schema", TOO_DEEP),
    ("prompt", [DEEP], "prompt", TOO_DEEP),
]


def _assert_refused(r: httpx.Response, param: str | None, says: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert says == error["code"] if says == UNSUPPORTED else says in error["message"], error


@pytest.mark.parametrize(("field", "value", "param", "says"), CHAT_CASES,
                         ids=[f"{c[0]}={str(c[1])[:24]!r}" for c in CHAT_CASES])
def test_chat_field_refused(server: Server, field: str, value: object, param: str | None, says: str) -> None:
    _assert_refused(_post(server, "chat/completions", CHAT | {field: value}), param, says)


@pytest.mark.parametrize(("field", "value", "param", "says"), TEXT_CASES,
                         ids=[f"{c[0]}={str(c[1])[:24]!r}" for c in TEXT_CASES])
def test_completion_field_refused(server: Server, field: str, value: object, param: str | None, says: str) -> None:
    _assert_refused(_post(server, "completions", TEXT | {field: value}), param, says)


def test_accepted_forms(server: Server, two: Path) -> None:
    """Neutral values of unsupported fields, nulls, unknown extras, text parts, one prompt in a
    list, token ids: all served."""
    chat = CHAT | {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "n": 1, "seed": 2**63 - 1,
                   "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "top_p": None,
                   "temperature": None, "stream": None, "user": "u1", "metadata": {"k": "v"}, "stop": [],
                   "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                {"role": "user", "content": "What is the capital of France?", "name": "x"}]}
    r = _post(server, "chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    one = _post(server, "completions", TEXT | {"prompt": ["The capital of France is"]}).json()
    assert one["choices"][0]["text"].startswith(" Paris")
    ids = ChatTokenizer(two).encode("The capital of France is")
    for prompt in (ids, [ids]):
        r = _post(server, "completions", TEXT | {"prompt": prompt})
        assert r.json()["choices"][0]["text"] == one["choices"][0]["text"]


def test_body_not_json_or_not_an_object(server: Server) -> None:
    for content, says in ((b"{not json", "not valid JSON"), (b"[]", "valid dictionary"),
                          (b"[" * 100_000 + b"]" * 100_000, "body: nested deeper than 64 levels"),
                          (b'{"model": "m", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
                          (b"", "not valid JSON")):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(CHAT),
                   headers={"content-type": "text/plain"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body")


def test_audit54_a_body_nested_past_the_parser_names_its_field(server: Server) -> None:
    """3,000 levels: past what Python's JSON parser takes (RecursionError), still the field."""
    for field in ("messages", "response_format", "tools", "chat_template_kwargs"):
        content = json.dumps(CHAT)[:-1] + f', "{field}": ' + "[" * 3000 + "]" * 3000 + "}"
        r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        _assert_refused(r, field, TOO_DEEP)
    r = _post(server, "chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_model_name_echoed_safely(server: Server) -> None:
    r = _post(server, "chat/completions", CHAT | {"model": "\ud800" + "x" * 1000})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(r.json()["error"]["message"]) < 200


def test_server_survives_hostile_requests(server: Server) -> None:
    """What once killed the engine thread (a temperature that underflows) and the rest of the
    table leave the server serving the same answers."""
    for case in CHAT_CASES:
        _post(server, "chat/completions", CHAT | {case[0]: case[1]})
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = _post(server, "chat/completions", CHAT | {"max_tokens": 16})
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


# --- body size ----------------------------------------------------------------------------------

def _raw_exchange(server: Server, head: bytes, chunks: Iterator[bytes]) -> tuple[int, dict[str, Any]]:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        data = b""
        while got := s.recv(65536):
            data += got
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_declared_body_over_limit_is_refused_unread(server: Server) -> None:
    """100 MiB announced and nothing sent: the answer comes at once (the client waits for
    100 Continue, which never comes)."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * 2**20}\r\nExpect: 100-continue\r\n\r\n").encode()
    t = time.monotonic()
    status, body = _raw_exchange(server, head, iter(()))
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert body["error"]["message"] == f"the request body is larger than the limit of {DEFAULT_MAX_BODY_BYTES} bytes"
    assert time.monotonic() - t < 1.5


def test_chunked_body_over_limit_is_refused(server: Server) -> None:
    def chunks() -> Iterator[bytes]:
        piece = b"x" * 65536
        for _ in range(DEFAULT_MAX_BODY_BYTES // len(piece) + 4):
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
    status, body = _raw_exchange(server, head, chunks())
    assert (status, body["error"]["code"]) == (413, "request_too_large")


def test_ordinary_client_gets_413_not_a_reset(server: Server) -> None:
    """A client that sends its whole oversized body before reading (httpx, the openai client)
    still reads the 413, with Content-Length and chunked."""
    big = json.dumps(CHAT | {"messages": [{"role": "user", "content": "x " * DEFAULT_MAX_BODY_BYTES}]}).encode()

    def streamed() -> Iterator[bytes]:
        yield from (big[i:i + 65536] for i in range(0, len(big), 65536))

    for content in (big, big, streamed(), streamed()):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client, \
            pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 2**20 * 2}])
    assert e.value.status_code == 413


def test_large_body_under_limit_is_tokenized_off_the_event_loop(server: Server) -> None:
    """A body just under the limit is read and tokenized (~1 s) in a worker thread, with the GIL
    released: meanwhile the server answers others at once; then the prompt is refused as
    longer than the context."""
    big = CHAT | {"messages": [{"role": "user", "content": "hello " * 320_000}]}
    assert len(json.dumps(big)) < DEFAULT_MAX_BODY_BYTES
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(_post, server, "chat/completions", big)
        time.sleep(0.3)
        asked = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        health_s = time.monotonic() - asked
        r = pending.result(timeout=60)
        total_s = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert health_s < 0.25 * total_s, (health_s, total_s)


# --- the body limit as ASGI middleware (no server) ----------------------------------------------

Message = dict[str, Any]


def _run_limit(limit: int, messages: Callable[[int], Message | None], headers: list[tuple[bytes, bytes]]
               ) -> tuple[list[Message], list[Message], int]:
    """Drive BodyLimit over an app that reads twice; returns what the app received, what was
    sent to the client, and how many messages were taken from the server. `messages(i)` is the
    server's i-th message (None: the client has gone)."""
    taken, got, sent = 0, [], []

    async def receive() -> Message:
        nonlocal taken
        taken += 1
        return messages(taken - 1) or {"type": "http.disconnect"}

    async def app(scope: Any, recv: Any, send: Any) -> None:
        got.append(await recv())
        got.append(await recv())
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(BodyLimit(app, limit)(scope, receive, send))  # type: ignore[arg-type]
    return got, sent, taken


def _chunks(n: int | None, chunk: bytes) -> Callable[[int], Message | None]:
    """n chunks, the last one ending the body (None: endless)."""
    def message(i: int) -> Message | None:
        if n is not None and i >= n:
            return None
        return {"type": "http.request", "body": chunk, "more_body": n is None or i < n - 1}
    return message


def test_middleware_passes_a_body_within_the_limit_in_one_message() -> None:
    got, sent, _ = _run_limit(100, _chunks(4, b"x" * 25), [(b"content-length", b"100")])
    assert got == [{"type": "http.request", "body": b"x" * 100, "more_body": False}, {"type": "http.disconnect"}]
    assert sent[0]["status"] == 200


def test_middleware_refuses_without_reading_more_than_it_must() -> None:
    # declared too large, client waiting for 100 Continue: nothing is read
    got, sent, taken = _run_limit(100, _chunks(3, b"x" * 50),
                                  [(b"content-length", b"150"), (b"expect", b"100-continue")])
    assert (got, sent[0]["status"], taken) == ([], 413, 0)
    # chunked and endless: the app never runs; reading stops at the discard bound (64 MiB)
    got, sent, taken = _run_limit(100, _chunks(None, b"x" * 2**20), [])
    assert got == [] and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert taken == 1 + 64


# --- overload -----------------------------------------------------------------------------------

def test_overloaded_server_answers_429_with_retry_after(two: Path) -> None:
    s = Server(two, "--max-streams", "1", "--max-queue", "0")
    try:
        held = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=held, timeout=60) as stream:
            lines = stream.iter_lines()  # held: the client's iterator, once dropped, closes the response
            next(lines)  # the only stream slot is taken
            r = httpx.post(f"{s.url}/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert (r.json()["error"]["code"], r.json()["error"]["type"]) == ("overloaded", "server_error")
            with openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0) as client, \
                    pytest.raises(openai.RateLimitError, match="overloaded"):
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            del lines
        assert s.metric('shardline_rejected_requests_total{reason="overloaded"}') == 2
        deadline = time.monotonic() + 30
        while s.metric("shardline_active_streams") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.post(f"{s.url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    finally:
        s.stop()


# --- in-process: a failed engine, failing templates, small body limits ----------------------------

@pytest.fixture(scope="module")
def engine(two: Path) -> Iterator[Engine]:
    trim_memory_every()  # the process's one memory trimmer, started by the first engine whichever test that is
    before = set(threading.enumerate())
    pipe = LocalPipeline(two, RunConfig())
    e = Engine(pipe, Limits(1, 0), 8192)
    yield e
    e.stop()
    pipe.shutdown()  # its stage threads, started by the first step a test ran
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, f"a thread was left behind: {set(threading.enumerate()) - before}"


def _call(served: Served, method: str, path: str, body: object = None,
          content: bytes | AsyncIterator[bytes] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            data = content if content is not None else (json.dumps(body) if body is not None else None)
            return await c.request(method, path, content=data, headers={"content-type": "application/json"})

    return asyncio.run(go())


def test_health_and_requests_when_the_engine_has_failed(engine: Engine, two: Path) -> None:
    served = Served(engine, ChatTokenizer(two), MODEL)
    ok = _call(served, "GET", "/health")
    stages = [{"instance": "", "index": 0, "where": "this process", "layers": [0, 14], "state": "up", "why": ""},
              {"instance": "", "index": 1, "where": "this process", "layers": [15, 29], "state": "up", "why": ""}]
    state = {"model": MODEL, "active_streams": 0, "waiting": 0, "context": 0, "kv_cache": "f32", "stages": stages}
    assert (ok.status_code, ok.json()) == (200, {"status": "ok", **state})
    engine.failed = "RuntimeError: device lost"
    try:
        sick = _call(served, "GET", "/health")
        assert sick.status_code == 503
        assert sick.json() == {"status": "unhealthy", "error": "the engine has stopped: RuntimeError: device lost",
                               **state}
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
            r = _call(served, "POST", path, body)
            assert r.status_code == 503
            assert r.json()["error"] == {"message": "the engine has failed: RuntimeError: device lost",
                                         "type": "server_error", "param": None, "code": "engine_failed"}
    finally:
        engine.failed = None


@pytest.mark.parametrize(("template", "says"), [
    # a template's own refusal (transformers' raise_exception) is the client's message
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
    ("{{ undefined_helper() }}", "UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    ("", "this model has no chat template"),
])
def test_template_failure_is_a_400(engine: Engine, two: Path, tmp_path: Path, template: str, says: str) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(two / name, tmp_path / name)
    cfg = json.loads((two / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": template}))
    r = _call(Served(engine, ChatTokenizer(tmp_path), MODEL), "POST", "/v1/chat/completions", CHAT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and says in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template(engine: Engine, two: Path, tmp_path: Path) -> None:
    """Qwen3's thinking switch as vLLM and llama-server take it: `chat_template_kwargs` are the
    template's variables (here a template that adds a line when enable_thinking is false)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(two / name, tmp_path / name)
    cfg = json.loads((two / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}\n<think>\n\n</think>\n\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": template}))
    served = Served(engine, ChatTokenizer(tmp_path), MODEL)
    used = {}
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
        r = _call(served, "POST", "/v1/chat/completions", CHAT | ({"chat_template_kwargs": kwargs} if kwargs else {}))
        assert r.status_code == 200, r.text
        used[str(kwargs)] = r.json()["usage"]["prompt_tokens"]
    plain = len(ChatTokenizer(tmp_path).tokens(CHAT["messages"][0]["content"]))  # type: ignore[index]
    think = len(ChatTokenizer(tmp_path).tokens("\n<think>\n\n</think>\n\n"))
    assert used == {"None": plain, "{'enable_thinking': True}": plain, "{'enable_thinking': False}": plain + think}


def test_configured_body_limit(engine: Engine, two: Path) -> None:
    served = Served(engine, ChatTokenizer(two), MODEL, max_body_bytes=1024)
    small = CHAT | {"model": "other"}  # parsed, then refused for its model: the body got through
    assert _call(served, "POST", "/v1/chat/completions", small).status_code == 404
    padded = small | {"user": "x" * 1024}
    r = _call(served, "POST", "/v1/chat/completions", padded)
    assert r.status_code == 413 and "limit of 1024 bytes" in r.json()["error"]["message"]

    async def chunked() -> AsyncIterator[bytes]:
        data = json.dumps(padded).encode()
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    r = _call(served, "POST", "/v1/chat/completions", content=chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
