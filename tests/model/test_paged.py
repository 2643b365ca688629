"""The paged stage graph (issue 41, export/paged.py) against the stateful one, on the default
model's two stages: PagedAttention over block pools the caller owns, one flat ragged batch per
call. Same greedy tokens, logits within float noise: a prompt over non-contiguous blocks, a
decode token and another stream's prompt in one call, two streams decoding together, and a
batch's rows each equal to the row run alone."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import openvino as ov
import pytest

from shardline.config import RunConfig
from shardline.export.graph import build_stage
from shardline.export.plan import even_split
from shardline.export.stateful import make_stateful
from shardline.export.weights import Weights
from shardline.model.source import open_source
from shardline.stage.paged_batch import PagedBatch
from shardline.stage.paged_runner import PagedRunner

BLOCKS = 16
Seq = tuple[Sequence[int], int, Sequence[int]]  # new tokens, past length, block table


class Stateful:
    """One stream through the stateful stages (the reference)."""

    def __init__(self, stages: list[ov.CompiledModel]) -> None:
        self.requests = [c.create_infer_request() for c in stages]
        self.past = 0

    def step(self, ids: Sequence[int]) -> np.ndarray:
        t, p = len(ids), self.past
        common = {"attention_mask": np.ones((1, p + t), np.int64), "position_ids": np.arange(p, p + t)[None],
                  "beam_idx": np.zeros(1, np.int32)}
        hidden = self.requests[0].infer({**common, "input_ids": np.array([ids], np.int64)})[0].copy()
        self.past += t
        out = self.requests[1].infer({**common, "hidden_states": hidden, "logits_index": np.array([[t - 1]])})
        return np.asarray(out[0]).reshape(-1).copy()


class Paged:
    """The paged stages (stage/paged_runner.py), each over its own block pool."""

    def __init__(self, stages: list[ov.Model]) -> None:
        props = RunConfig().ov_properties()
        self.runners = [PagedRunner(m, "CPU", props, BLOCKS, vocab=49152) for m in stages]

    def step(self, seqs: Sequence[Seq]) -> np.ndarray:
        """The logits of each sequence's last new token, [S, V]."""
        ends = np.cumsum([len(ids) for ids, _, _ in seqs])
        batch = PagedBatch.of([(len(ids), p, b) for ids, p, b in seqs], logits_at=(ends - 1).tolist())
        hidden = self.runners[0].run(batch, np.concatenate([np.asarray(ids, np.int64) for ids, _, _ in seqs])).copy()
        return self.runners[1].run(batch, hidden).copy()


@pytest.fixture(scope="module")
def stages() -> Iterator[tuple[list[ov.CompiledModel], list[ov.Model]]]:
    source = open_source(None)
    plans = even_split(source.arch.n_layers, 2)
    w, core, props = Weights(source, "gguf"), ov.Core(), RunConfig().ov_properties()
    stateful = [core.compile_model(make_stateful(build_stage(source.arch, p, w)), "CPU", props) for p in plans]
    paged = [build_stage(source.arch, p, w, paged=True) for p in plans]
    # The graphs' constants share the weights' numpy buffers: `w` lives as long as the stages.
    yield stateful, paged
    del stateful, paged, w, source


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def test_the_pool_is_blocks_of_the_plugins_choosing(stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    runner = Paged(stages[1]).runners[0]
    key = next(i for i in runner.compiled.inputs if i.get_any_name() == "key_cache.0")
    shape = key.get_partial_shape()
    assert shape[1].get_length() == 3 and shape[3].get_length() == 64  # SmolLM2's KV heads, head size
    assert shape[2].get_length() == 32  # this plugin's CPU block
    assert runner.block_size == 32 and runner.pool_bytes() == 15 * 2 * BLOCKS * 3 * 32 * 64 * 4  # f32 KV
    assert {i.get_any_name() for i in runner.compiled.inputs} >= {"input_ids", "position_ids", "past_lens",
                                                              "subsequence_begins", "block_indices",
                                                              "block_indices_begins", "max_context_len"}


def test_a_ragged_batch_gives_the_stateful_tokens(stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    stateful, paged = stages
    a, b, pool = Stateful(stateful), Stateful(stateful), Paged(paged)
    prompt_a, prompt_b = _prompt(0, 40), _prompt(1, 15)
    want = a.step(prompt_a)
    got = pool.step([(prompt_a, 0, [3, 1])])  # 40 tokens over two blocks, out of order
    assert np.abs(got[0] - want).max() < 1e-3 and int(got[0].argmax()) == int(want.argmax())
    # a decode token of A and B's whole prompt, one call
    token = int(want.argmax())
    want_a, want_b = a.step([token]), b.step(prompt_b)
    got = pool.step([([token], 40, [3, 1]), (prompt_b, 0, [5])])
    assert np.abs(got[0] - want_a).max() < 1e-3 and np.abs(got[1] - want_b).max() < 1e-3
    # both decode together, A's table growing into a third block, B's into a second
    tokens_a, tokens_b, past_a, past_b = [int(want_a.argmax())], [int(want_b.argmax())], 41, 15
    for _ in range(24):
        want_a, want_b = a.step(tokens_a[-1:]), b.step(tokens_b[-1:])
        # Each table covers its past and new token: PagedAttention itself checks nothing (a table
        # one block short writes past the pool: a crash, seen here), the paged runner must.
        table_a, table_b = [3, 1, 7][: -(-(past_a + 1) // 32)], [5, 2][: -(-(past_b + 1) // 32)]
        got = pool.step([(tokens_a[-1:], past_a, table_a), (tokens_b[-1:], past_b, table_b)])
        assert [int(got[0].argmax()), int(got[1].argmax())] == [int(want_a.argmax()), int(want_b.argmax())]
        tokens_a.append(int(want_a.argmax()))
        tokens_b.append(int(want_b.argmax()))
        past_a, past_b = past_a + 1, past_b + 1


def test_a_fused_batch_equals_its_rows_alone(stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    _, paged = stages
    fused, alone = Paged(paged), Paged(paged)
    p, q = _prompt(2, 33), _prompt(3, 7)
    both = fused.step([(p, 0, [0, 1]), (q, 0, [2])])
    first, second = alone.step([(p, 0, [0, 1])]), alone.step([(q, 0, [2])])
    assert np.array_equal(both.argmax(-1), np.concatenate([first, second]).argmax(-1))
    assert np.abs(both - np.concatenate([first, second])).max() < 1e-3


def test_a_hostile_batch_is_refused_and_the_pool_left_as_it_was(
        stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    from shardline.errors import StepRefused

    stateful, paged = stages
    ref, pool = Stateful(stateful), Paged(paged)
    prompt = _prompt(4, 40)
    ref.step(prompt)
    pool.step([(prompt, 0, [3, 1])])
    caches = [next(i for i in r.compiled.inputs if "key_cache." in i.get_any_name()) for r in pool.runners]
    before = [r.request.get_tensor(c).data.copy() for r, c in zip(pool.runners, caches, strict=True)]
    hostile = {
        "need 2 blocks, its table has 1": [([7], 40, [3])],  # unchecked, the op writes past the table
        "outside the pool": [([7], 40, [3, BLOCKS])],
        "written by sequences 0 and 1": [([7], 40, [3, 1]), ([8], 40, [3, 1])],
    }
    for reason, seqs in hostile.items():
        with pytest.raises(StepRefused, match=reason):
            pool.step(seqs)
    with pytest.raises(StepRefused, match="outside the vocabulary"):
        pool.step([([49152], 40, [3, 1])])
    after = [r.request.get_tensor(c).data for r, c in zip(pool.runners, caches, strict=True)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    want = ref.step([7])  # and the stream goes on as if nothing had been asked
    assert int(pool.step([([7], 40, [3, 1])])[0].argmax()) == int(want.argmax())


def test_a_prefix_hit_reads_shared_blocks_with_no_copy(stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    """The block pool (serving/kv_blocks.py) and the paged stages together: a second prompt that
    starts with the first's full blocks maps them into its table and computes only its own tail."""
    from shardline.serving.kv_blocks import BlockPool

    stateful, paged = stages
    shared = _prompt(5, 64)  # two full blocks
    first, second = shared + _prompt(6, 9), shared + _prompt(7, 5)
    pool, runner = BlockPool(BLOCKS, 32), Paged(paged)
    a = pool.match(first, "key")
    pool.grow(a, len(first))
    runner.step([(first, 0, a.blocks)])
    pool.wrote(a, first, "key")
    b = pool.match(second, "key")
    assert b.blocks == a.blocks[:2] and b.written == 64  # the hit: a's blocks, referenced
    pool.grow(b, len(second))
    got = runner.step([(second[b.written :], b.written, b.blocks)])  # only the 5 new tokens run
    want = Stateful(stateful).step(second)
    assert np.abs(got[0] - want).max() < 1e-3 and int(got[0].argmax()) == int(want.argmax())


def test_rejected_drafts_are_trimmed_by_the_past_length(stages: tuple[list[ov.CompiledModel], list[ov.Model]]) -> None:
    """Speculation on blocks: a verify step writes 4 positions; the 2 rejected ones are undone by
    a shorter past length alone (the next token overwrites their slots), no mask, no compaction."""
    stateful, paged = stages
    prompt = _prompt(8, 30)
    ref, runner = Stateful(stateful), Paged(paged)
    first = int(ref.step(prompt).argmax())
    runner.step([(prompt, 0, [0])])
    drafts = [first, 11, 12, 13]  # the model's token, then drafts that are mostly wrong
    runner.step([(drafts, 30, [0, 1])])  # verify: positions 30-33 written into blocks 0 and 1
    kept = drafts[:2]  # say two stood: the past is now 32, the slots of 32-33 are stale
    ref.step(kept)
    want = ref.step([5])
    got = runner.step([([5], 32, [0, 1])])
    assert np.abs(got[0] - want).max() < 1e-3 and int(got[0].argmax()) == int(want.argmax())
