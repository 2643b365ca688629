"""A request's prompt as token ids, computed off the event loop.

Rendering a chat template and tokenizing take up to seconds for a prompt near the body size
limit, so they run in a worker thread (ChatTokenizer.encode releases the GIL while it works).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from shardline.api.schemas import ApiError
from shardline.model.tokenizer import ChatTokenizer

T = TypeVar("T")


async def tokenize(work: Callable[[ChatTokenizer, T], list[int]], tok: ChatTokenizer, what: T,
                   param: str) -> list[int]:
    """Token ids from `work` in a worker thread; any failure is the input's (a chat template is a
    program run on client text: whatever it raises, it refuses the request) and becomes a 400."""
    try:
        return await run_in_threadpool(work, tok, what)
    except Exception as e:
        raise ApiError(400, f"{param}: cannot be tokenized: {type(e).__name__}: {e}", param=param) from None
