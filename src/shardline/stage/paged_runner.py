"""A paged stage (issue 41): one compiled paged graph (export/paged.py) and its KV block pools,
one per attention input, each `blocks` blocks of the size the device chose. It holds no per-stream
state: which blocks a stream uses is the coordinator's (serving/kv_blocks.py), and every call
says so in its batch (stage/paged_batch.py), checked against the pool first.

Not a `Stage` (stage/runners.py): it holds no keys, so nothing keyed (merges, KV moves) applies.
A paged pipeline (pipeline/paged_local.py) runs ragged steps through these. A worker serving
several coordinators gives each session a pool of its own (`pool`): one compiled graph, one
request and one set of block pools per session, so no session reads another's blocks.

A pool costs what its written blocks hold, not what it may hold: its arrays are numpy zeros
(calloc: fresh pages the OS maps to its zero page until first written) that the request's tensors
share, not copy. So a pool is committed block by block as steps and moves write its blocks, and
a Hello asking for a large pool costs nothing until its blocks are used (issue 54: a copying
`ov.Tensor(zeros)` committed every page at once, 1 GiB on a 200-byte Hello). The plugin runs
PagedAttention in place over these buffers: a block a step writes is in the pool's array, and
a move reads it there (tests/model/test_paged_worker.py checks both). So a session's pools cost
at most their `nbytes`, page by page; a worker bounds their sum (node/paged.py pools_for,
`worker --kv-cache-mb`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from shardline.config import RunConfig
from shardline.errors import ShardlineError, StepRefused
from shardline.model.manifest import StageEntry
from shardline.model.paged_ir import joined
from shardline.stage.block_ops import read_stage
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.resident import released_while
from shardline.stage.runner import precision_properties

WARM_CHUNK = 16  # tokens of the warm-up's chunk (`_warm_up`: past the kernels' thresholds, short)


@dataclass(eq=False)
class Pool:
    """A request of the compiled graph with its own block pools (one per attention input)."""

    request: ov.InferRequest
    blocks: int
    nbytes: int  # its block tensors' bytes: the most it commits, page by page as blocks are written
    # The arrays the request's tensors share (an ov.Tensor over shared memory does not own it):
    # they live as long as the pool does.
    arrays: tuple[np.ndarray, ...] = ()


class PagedRunner:
    def __init__(self, model: ov.Model, device: str, properties: dict[str, str], blocks: int,
                 core: ov.Core | None = None, vocab: int | None = None, context: int | None = None) -> None:
        self.compiled = (core or ov.Core()).compile_model(model, device, properties)
        names = {i.get_any_name() for i in self.compiled.inputs}
        self._input = "input_ids" if "input_ids" in names else "hidden_states"
        self.has_head = "logits_index" in names
        width = self.compiled.input(self._input).partial_shape
        self.hidden = None if self._input == "input_ids" else int(width[1].get_length())
        self.vocab, self.context = vocab, context
        self.entry: StageEntry | None = None  # the manifest's, when loaded from an export
        self._pools = [i for i in self.compiled.inputs if "_cache." in i.get_any_name()]
        if not self._pools:
            raise ShardlineError("not a paged stage: its graph has no key_cache/value_cache inputs")
        # [blocks, kv_heads, block, head_dim] as the device laid them out
        self._dims = [[d.get_length() for d in list(i.get_partial_shape())[1:]] for i in self._pools]
        self.block_size = int(self._dims[0][1])
        self.allocate(blocks)
        self._warm_up()

    def _warm_up(self) -> None:
        """A decode token, then a short chunk, through a scratch pool: the plugin repacks its
        weights here (reading the mapped shard), not in a client's first steps, and `load` hands
        the shard's pages back once it has (resident.py), so a served stage never holds them
        twice. Two sizes, because the CPU plugin keeps one repacked copy per kind of matmul
        kernel and picks the kind by the tokens of a call (measured on the default model, issue
        54: 1-6 tokens one, 7 and more another). A short chunk, not a long one: a 128-token call
        read the mapped weights without keeping a copy, and a 7-token call later repacked them
        from the file all the same. This runner's pools are not written."""
        tokens = min(WARM_CHUNK, self.context or WARM_CHUNK)
        scratch = self.pool(-(-tokens // self.block_size))
        for n in sorted({1, tokens}):
            x = np.zeros(n, np.int64) if self.hidden is None else np.zeros((n, self.hidden), np.float32)
            table = tuple(range(-(-n // self.block_size)))
            self.run(PagedBatch.of([(n, 0, table)], logits_at=[n - 1] if self.has_head else []), x, scratch)

    def block_bytes(self) -> int:
        """What one block costs this stage: its layers' keys and values for `block_size` tokens."""
        return sum(int(np.prod(d)) * i.get_element_type().size for i, d in zip(self._pools, self._dims, strict=True))

    def pool(self, blocks: int) -> Pool:
        """A new request over pools of `blocks` blocks, committed as blocks are written (the
        module's docstring: shared zeros, never copied)."""
        if blocks < 1:
            raise ShardlineError(f"a paged stage needs a pool of at least 1 block, not {blocks}")
        request = self.compiled.create_infer_request()
        arrays = []
        for i, dims in zip(self._pools, self._dims, strict=True):
            zeros = np.zeros([blocks, *dims], i.get_element_type().to_dtype())
            request.set_tensor(i.get_any_name(), ov.Tensor(zeros, shared_memory=True))
            arrays.append(zeros)
        return Pool(request, blocks, blocks * self.block_bytes(), tuple(arrays))

    def allocate(self, blocks: int) -> None:
        """This runner's own pool: `blocks` blocks (the one `run` uses unless given another)."""
        self.own = self.pool(blocks)

    @property
    def blocks(self) -> int:
        return self.own.blocks

    @property
    def request(self) -> ov.InferRequest:
        return self.own.request

    @staticmethod
    def load(folder: Path, entry: StageEntry, run: RunConfig, blocks: int, core: ov.Core | None = None,
             vocab: int | None = None, context: int | None = None) -> PagedRunner:
        """`entry` (a manifest's "paged" stage) compiled on `run`'s one device with a pool of
        `blocks` blocks; a clear error for another kind or a graph the device refuses."""
        if entry.runner != "paged":
            raise ShardlineError(f"{entry.name} of {folder} is a {entry.runner!r} stage, not a paged one")
        core = core or ov.Core()
        try:
            read, weights_file = read_stage(core, folder / entry.xml, run)
            model = joined(read)
            with released_while(weights_file):  # resident.py: why
                runner = PagedRunner(model, run.device, precision_properties(model, run), blocks, core, vocab, context)
        except (RuntimeError, ValueError, KeyError) as e:
            lines = [x for x in str(e).strip().splitlines() if not x.startswith("Exception from")]
            why = lines[0] if lines else type(e).__name__
            raise ShardlineError(f"cannot load {entry.name} from {folder} on {run.device}: {why}") from None
        runner.entry = entry
        return runner

    def kv_layout(self) -> dict[str, tuple[np.dtype, int, int]]:
        """Each pool's (dtype, kv_heads, head_dim), as a moved stream's KV must fit it."""
        return {i.get_any_name(): (np.dtype(i.get_element_type().to_dtype()), d[0], d[2])
                for i, d in zip(self._pools, self._dims, strict=True)}

    def read(self, blocks: tuple[int, ...], tokens: int, pool: Pool | None = None) -> dict[str, np.ndarray]:
        """The KV of the first `tokens` tokens held in `blocks` (in order), per pool, as one row
        of that many slots: [1, kv_heads, tokens, head_dim] (a copy)."""
        self._movable(blocks, tokens, pool or self.own)
        out = {}
        for i in self._pools:
            a = (pool or self.own).request.get_tensor(i).data[list(blocks)]  # [n, heads, block, dim]
            out[i.get_any_name()] = np.ascontiguousarray(
                a.transpose(1, 0, 2, 3).reshape(a.shape[1], -1, a.shape[3])[None, :, :tokens])
        return out

    def write(self, blocks: tuple[int, ...], arrays: dict[str, np.ndarray], pool: Pool | None = None) -> None:
        """`arrays` ([1, kv_heads, tokens, head_dim] per pool, as `read` gives them) into `blocks`."""
        pool = pool or self.own
        tokens = next(iter(arrays.values())).shape[2] if arrays else 0
        self._movable(blocks, tokens, pool)
        for i in self._pools:
            name, data = i.get_any_name(), pool.request.get_tensor(i).data
            a = arrays[name][0]  # [heads, tokens, dim]
            padded = np.zeros((a.shape[0], len(blocks) * self.block_size, a.shape[2]), a.dtype)
            padded[:, :tokens] = a
            data[list(blocks)] = padded.reshape(a.shape[0], len(blocks), self.block_size, -1).transpose(1, 0, 2, 3)

    def _movable(self, blocks: tuple[int, ...], tokens: int, pool: Pool) -> None:
        if any(d[1] != self.block_size for d in self._dims):
            raise ShardlineError("this device lays KV blocks out in a way a move does not know (not tokens on axis 2)")
        if not blocks or min(blocks) < 0 or max(blocks) >= pool.blocks or len(set(blocks)) != len(blocks):
            raise ShardlineError(f"KV blocks {list(blocks)[:8]} are not distinct blocks of a pool of {pool.blocks}")
        if not 0 < tokens <= len(blocks) * self.block_size:
            raise ShardlineError(f"{tokens} tokens do not fit {len(blocks)} blocks of {self.block_size}")
        if len(blocks) != (need := -(-tokens // self.block_size)):
            # a move is one stream's blocks for its tokens, no more: what it reads or writes
            # stays in proportion to the tokens, whatever the list a peer sends
            raise ShardlineError(f"{tokens} tokens take {need} blocks of {self.block_size}, not {len(blocks)}")

    def pool_bytes(self, pool: Pool | None = None) -> int:
        return (pool or self.own).nbytes

    def run(self, batch: PagedBatch, x: np.ndarray, pool: Pool | None = None) -> np.ndarray:
        """The batch's hidden states [T, H], or on the last stage the logits [N, V] at
        `batch.logits_at`; `x` is the batch's token ids [T] (stage 0) or hidden states [T, H].
        StepRefused, the pool untouched, for a batch that does not fit. The result is a view of
        the request's output: valid until the next call. `pool`: a session's (else this runner's)."""
        pool = pool or self.own
        batch.check(pool.blocks, self.block_size, self.context)
        feed = {**batch.feed(), self._input: self._checked(batch, x)}
        if self.has_head:
            if not batch.logits_at.size:
                raise StepRefused("the last stage's batch asks for no logits")
            feed["logits_index"] = batch.logits_at
        pool.request.infer(feed, share_inputs=False)
        return pool.request.get_output_tensor(0).data

    def _checked(self, batch: PagedBatch, x: np.ndarray) -> np.ndarray:
        t = batch.tokens
        if self.hidden is None:
            if x.shape != (t,) or x.dtype != np.int64 or (x.size and (int(x.min()) < 0 or
                                                                     (self.vocab and int(x.max()) >= self.vocab))):
                raise StepRefused(f"token ids {x.dtype}{x.shape} for a batch of {t} (or outside the vocabulary)")
        elif x.shape != (t, self.hidden) or x.dtype != np.float32:
            raise StepRefused(f"hidden states {x.dtype}{x.shape}; expected float32{(t, self.hidden)}")
        return x
