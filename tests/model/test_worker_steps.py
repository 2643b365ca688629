"""A worker's step handling, in process: a first prefill may overtake its OpenStream; a decode
for a stream the worker never saw is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardline.node.worker import StageWorker
from shardline.pipeline.timing import no_hops
from shardline.wire.messages import Forward, Message, Refuse, Route, Sampled


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, msg: Message, stamp: bool = False) -> None:  # Link.send's signature
        self.sent.append(msg)


def _forward(stream: int, slots: int, t: int) -> Forward:
    hidden = np.random.default_rng(0).standard_normal((1, t, 576)).astype(np.float16)
    return Forward(stream, 0, "prefill" if slots == 0 else "decode", [stream], [0], [], hidden,
                   np.ones((1, slots + t), np.uint8), np.arange(slots, slots + t, dtype=np.int64)[None],
                   [{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}], False, no_hops())


def test_prefill_before_open_and_unknown_decode(shards: Callable[..., Path]) -> None:
    worker = StageWorker(shards("fp32", stages=2), 1, 1)
    link = Recorder()
    worker.handle(link, Route(""))  # type: ignore[arg-type]
    worker.handle(link, _forward(5, 0, 3))  # type: ignore[arg-type]
    worker.handle(link, _forward(5, 3, 1))  # type: ignore[arg-type]
    worker.handle(link, _forward(9, 3, 1))  # type: ignore[arg-type]
    kinds = [type(m) for m in link.sent]
    assert kinds == [Sampled, Sampled, Refuse]
    assert "unknown stream 9" in link.sent[2].reason  # type: ignore[union-attr]
