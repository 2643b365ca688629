"""Steps on the real model, in process (exact precision): chunked prefill equals whole prefill,
K known tokens in one step equal K steps of one, logits only where tokens are chosen."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardline.config import RunConfig
from shardline.model.tokenizer import ChatTokenizer
from shardline.pipeline.local import LocalPipeline
from shardline.pipeline.plan import decode, prefill, run
from shardline.stage.cache import KVBook, StepInputs
from tests.conftest import CHAT_PROMPTS
from tests.helpers import GREEDY, chain, greedy_ours, ok

EXACT = RunConfig(precision="exact")


@pytest.fixture(scope="module")
def setup(shards: Callable[..., Path]) -> tuple[LocalPipeline, list[list[int]]]:
    folder = shards("gguf", stages=2)
    tok = ChatTokenizer(folder)
    return LocalPipeline(folder, EXACT), [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.mark.parametrize("chunk", [1, 5, 16, 32])
def test_chunked_prefill_gives_the_tokens_of_whole_prefill(setup: tuple[LocalPipeline, list[list[int]]],
                                                           chunk: int) -> None:
    pipe, prompts = setup
    for prompt in prompts[:2 if chunk == 1 else 5]:
        assert greedy_ours(pipe, prompt, 24, chunk=chunk)[0] == greedy_ours(pipe, prompt, 24)[0]


def test_k_known_tokens_in_one_step_give_each_position_its_own_argmax(
        setup: tuple[LocalPipeline, list[list[int]]]) -> None:
    """The verify step of speculation: feed the K tokens greedy would make, ask for the next
    token after each; every answer is the token greedy made there."""
    pipe, prompts = setup
    for prompt in prompts[:3]:
        greedy, rows = greedy_ours(pipe, prompt, 9)
        key, book = 1, KVBook()
        ok(run(pipe, prefill(key, book, prompt, GREEDY, first=True, last=True)))
        (out,) = ok(run(pipe, decode(key, book, greedy[:8], GREEDY, sample_all=True, want_logits=True)))
        pipe.release(key)
        assert [c.token for c in out.choices] == greedy[1:9]
        np.testing.assert_allclose(np.stack([np.asarray(c.logits) for c in out.choices]), rows[1:9], atol=2e-3)


def test_logits_only_where_tokens_are_chosen(shards: Callable[..., Path]) -> None:
    """A prefill's last stage computes the lm_head for the sampled position alone: its output
    buffer stays one row (it was [1, T, vocab]: 48 of a stream's 61 MB at 256 tokens), and a
    step that asks for three positions gets exactly the logits a fresh prefill has there."""
    pipe = LocalPipeline(shards("gguf", stages=2), EXACT)
    head = pipe.stages[-1]
    prompt = list(range(100, 140))
    book = KVBook()
    inputs = book.plan(prompt)
    book.commit(inputs)
    for s in pipe.stages:
        s.open("a")
    assert chain(pipe.stages, "a", inputs).shape == (1, 1, 49152)
    assert list(head._keys["a"].request.get_tensor(head.compiled.output(0)).shape) == [1, 1, 49152]
    three = book.plan([5, 6, 7])
    continued = chain(pipe.stages, "a", StepInputs(three.input_ids, three.attention_mask, three.position_ids,
                                                    logits_index=np.array([[0, 1, 2]])))
    fresh_book = KVBook()
    whole = fresh_book.plan([*prompt, 5, 6, 7])
    for s in pipe.stages:
        s.open("b")
    fresh = chain(pipe.stages, "b", StepInputs(whole.input_ids, whole.attention_mask, whole.position_ids,
                                               logits_index=np.array([[40, 41, 42]])))
    assert continued.shape == (1, 3, 49152)
    assert np.abs(continued - fresh).max() < 2e-3
    nothing = chain(pipe.stages, "b", StepInputs(*_plan(43, [8, 9]), logits_index=np.zeros((1, 0), np.int64)))
    assert nothing.shape == (1, 0, 49152)  # a prompt chunk that is not the last: no lm_head at all


def _plan(slots: int, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = len(tokens)
    return (np.array([tokens], np.int64), np.ones((1, slots + t), np.int64),
            np.arange(slots, slots + t, dtype=np.int64)[None])
