"""A paged stage (issue 41): one compiled paged graph (export/paged.py) and its KV block pools,
one per attention input, each `blocks` blocks of the size the device chose. It holds no per-stream
state: which blocks a stream uses is the coordinator's (serving/kv_blocks.py), and every call
says so in its batch (stage/paged_batch.py), checked against the pool first.

Not yet a `Stage` (stage/runners.py): the engine's plans still name keys and rows. What serves
with it is issue 41's next part; today tests and bench/paged_graph.py drive it.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from shardline.errors import ShardlineError, StepRefused
from shardline.stage.paged_batch import PagedBatch


class PagedRunner:
    def __init__(self, model: ov.Model, device: str, properties: dict[str, str], blocks: int,
                 core: ov.Core | None = None, vocab: int | None = None, context: int | None = None) -> None:
        if blocks < 1:
            raise ShardlineError(f"a paged stage needs a pool of at least 1 block, not {blocks}")
        self.compiled = (core or ov.Core()).compile_model(model, device, properties)
        names = {i.get_any_name() for i in self.compiled.inputs}
        self._input = "input_ids" if "input_ids" in names else "hidden_states"
        self.has_head = "logits_index" in names
        width = self.compiled.input(self._input).partial_shape
        self.hidden = None if self._input == "input_ids" else int(width[1].get_length())
        self.vocab, self.context, self.blocks = vocab, context, blocks
        self.request = self.compiled.create_infer_request()
        self.block_size = 0
        for i in self.compiled.inputs:  # [blocks, kv_heads, block, head_dim] as the device laid them out
            if "_cache." in i.get_any_name():
                dims = [d.get_length() for d in list(i.get_partial_shape())[1:]]
                self.block_size = self.block_size or int(dims[1])
                zeros = np.zeros([blocks, *dims], i.get_element_type().to_dtype())
                self.request.set_tensor(i.get_any_name(), ov.Tensor(zeros))
        if not self.block_size:
            raise ShardlineError("not a paged stage: its graph has no key_cache/value_cache inputs")

    def pool_bytes(self) -> int:
        pools = [i for i in self.compiled.inputs if "_cache." in i.get_any_name()]
        return sum(self.request.get_tensor(i).data.nbytes for i in pools)

    def run(self, batch: PagedBatch, x: np.ndarray) -> np.ndarray:
        """The batch's hidden states [T, H], or on the last stage the logits [N, V] at
        `batch.logits_at`; `x` is the batch's token ids [T] (stage 0) or hidden states [T, H].
        StepRefused, the pool untouched, for a batch that does not fit. The result is a view of
        the request's output: valid until the next call."""
        batch.check(self.blocks, self.block_size, self.context)
        feed = {**batch.feed(), self._input: self._checked(batch, x)}
        if self.has_head:
            if not batch.logits_at.size:
                raise StepRefused("the last stage's batch asks for no logits")
            feed["logits_index"] = batch.logits_at
        self.request.infer(feed, share_inputs=False)
        return self.request.get_output_tensor(0).data

    def _checked(self, batch: PagedBatch, x: np.ndarray) -> np.ndarray:
        t = batch.tokens
        if self.hidden is None:
            if x.shape != (t,) or x.dtype != np.int64 or (x.size and (int(x.min()) < 0 or
                                                                     (self.vocab and int(x.max()) >= self.vocab))):
                raise StepRefused(f"token ids {x.dtype}{x.shape} for a batch of {t} (or outside the vocabulary)")
        elif x.shape != (t, self.hidden) or x.dtype != np.float32:
            raise StepRefused(f"hidden states {x.dtype}{x.shape}; expected float32{(t, self.hidden)}")
        return x
