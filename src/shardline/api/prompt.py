"""A request's prompt as token ids, computed off the event loop.

Rendering a chat template and tokenizing take up to seconds for a prompt near the body size
limit, so they run in a worker thread. A worker thread is not enough on its own: `tokenizers`'
`Tokenizer.encode` keeps the GIL for the whole call, which would stall the event loop (every
other stream's tokens) just the same; `encode_batch` releases it, so a batch of one is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from shardline.api.schemas import ApiError
from shardline.model.tokenizer import ChatTokenizer

T = TypeVar("T")


def encode(tok: ChatTokenizer, text: str) -> list[int]:
    """`ChatTokenizer.encode` (no special tokens added, then BOS if the model wants it), with
    the GIL released while the tokenizer works."""
    ids = list(tok._tok.encode_batch([text], add_special_tokens=False)[0].ids)
    return [tok.bos_id, *ids] if tok.add_bos and tok.bos_id is not None else ids


def decode(tok: ChatTokenizer, ids: list[int]) -> str:
    """`ChatTokenizer.decode`, with the GIL released (`decode_batch`)."""
    return str(tok._tok.decode_batch([ids], skip_special_tokens=True)[0])


def encode_chat(tok: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    return encode(tok, tok.chat_prompt(messages))


async def tokenize(work: Callable[[ChatTokenizer, T], list[int]], tok: ChatTokenizer, what: T,
                   param: str) -> list[int]:
    """Token ids from `work` in a worker thread; any failure is the input's (a chat template is a
    program run on client text: whatever it raises, it refuses the request) and becomes a 400."""
    try:
        return await run_in_threadpool(work, tok, what)
    except Exception as e:
        raise ApiError(400, f"{param}: cannot be tokenized: {type(e).__name__}: {e}", param=param) from None
