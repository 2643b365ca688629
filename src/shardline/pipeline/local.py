"""All stages of an export chained in one process (the reference for every distributed path)."""

from __future__ import annotations

from itertools import count
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig, SamplingConfig
from shardline.decoding.sampler import Choice, Sampler
from shardline.errors import ShardlineError
from shardline.export.manifest import Manifest, load_manifest, verify
from shardline.stage.cache import KVBook, Step
from shardline.stage.runner import StageRunner


class LocalPipeline:
    def __init__(self, folder: Path, run: RunConfig | None = None, check: bool = True) -> None:
        run = run or RunConfig()
        self.folder = folder
        self.manifest: Manifest = load_manifest(folder)
        if check:
            verify(folder, self.manifest)
        core = ov.Core()
        self.stages = [StageRunner(folder, e, run, core) for e in self.manifest.stages]
        self._books: dict[int, KVBook] = {}
        self._samplers: dict[int, Sampler] = {}
        self._ids = count()

    def open(self, sampling: SamplingConfig | None = None) -> int:
        stream = next(self._ids)
        for s in self.stages:
            s.open(stream)
        self._books[stream] = KVBook()
        self._samplers[stream] = Sampler(sampling or SamplingConfig())
        return stream

    def close(self, stream: int) -> None:
        for s in self.stages:
            s.close(stream)
        self._books.pop(stream, None)
        self._samplers.pop(stream, None)

    def book(self, stream: int) -> KVBook:
        return self._books[stream]

    def step(self, stream: int, step: Step) -> np.ndarray:
        """Run one prefill or decode step through every stage; returns logits [T, vocab]."""
        if stream not in self._books:
            raise ShardlineError(f"unknown stream {stream}")
        book = self._books[stream]
        inputs = book.plan(step)
        hidden = None
        for stage in self.stages:
            hidden = stage.run(stream, inputs, hidden)
        book.commit(inputs)
        assert hidden is not None
        return hidden[0]

    def advance(self, stream: int, step: Step) -> Choice:
        """One step, sampled with the stream's own (seeded) sampler."""
        return self._samplers[stream].choose(self.step(stream, step)[-1])
