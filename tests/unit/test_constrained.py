"""Constrained decoding's pure parts (issue 40): token masks as steps carry them, the sampler
choosing only among allowed tokens, a step's masks from its rows' grammar states, and drafts cut
where they leave the grammar. The grammar here is a toy: after token t only t + 1 may follow."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.decoding.drafts import Proposal
from shardline.decoding.masks import TokenMasks, mask_words
from shardline.decoding.sampler import choose, choose_at
from shardline.serving.constrained import token_masks, within_grammar

V = 70  # three i32 words, the last one partly used


def bits_of(allowed: list[int], vocab: int = V) -> np.ndarray:
    b = np.zeros(mask_words(vocab) * 32, np.uint8)
    b[allowed] = 1
    return np.packbits(b, bitorder="little").view(np.int32)


class Counting:
    """Toy grammar: the next token is the last one plus 1 (from `start`)."""

    def __init__(self, start: int) -> None:
        self.last = start - 1
        self.calls = 0
        self.failure: str | None = None
        self.label = "counting"

    def masks(self, drafts: list[int]) -> np.ndarray:
        self.calls += 1
        return np.stack([bits_of([self.last + 1 + i]) for i in range(len(drafts) + 1)])

    def valid(self, drafts: list[int]) -> int:
        n = 0
        for i, d in enumerate(drafts):
            if d != self.last + 1 + i:
                break
            n += 1
        return n

    def advance(self, token: int) -> None:
        assert token == self.last + 1
        self.last = token

    def ends(self, token: int) -> bool:
        return False


def test_bit_layout_is_llguidance_little_endian() -> None:
    m = TokenMasks(np.stack([bits_of([0, 31, 32, 69])]), np.array([0, -1], np.int64))
    allowed = m.allowed(0, V)
    assert allowed is not None and list(np.flatnonzero(allowed)) == [0, 31, 32, 69]
    assert m.allowed(1, V) is None


def test_greedy_and_sampled_choices_stay_inside_the_mask() -> None:
    logits = np.arange(V, dtype=np.float32)  # the free argmax is V - 1
    allowed = np.zeros(V, bool)
    allowed[[3, 7]] = True
    assert choose(logits, SamplingParams(), 0, allowed=allowed).token == 7
    drawn = {choose(logits, SamplingParams(temperature=1.0, seed=s), 5, allowed=allowed).token for s in range(40)}
    assert drawn == {3, 7}
    c = choose(logits, SamplingParams(), 0, allowed=allowed)
    own = float(logits[7] - np.log(np.exp(logits.astype(np.float64)).sum()))  # the model's own, unconstrained
    assert c.logprob == pytest.approx(own)


def test_a_mask_allowing_nothing_is_an_error_not_a_token() -> None:
    with pytest.raises(ValueError, match="allows no token"):
        choose(np.zeros(V, np.float32), SamplingParams(), 0, allowed=np.zeros(V, bool))


def test_choose_at_applies_each_entrys_mask() -> None:
    logits = np.tile(np.arange(V, dtype=np.float32), (2, 2, 1))  # [B=2, N=2, V]
    masks = TokenMasks(np.stack([bits_of([5]), bits_of([9])]), np.array([1, -1, 0, -1], np.int64))
    at = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], np.int64)
    got = choose_at(logits, at, np.array([0, 1, 0, 1]), np.zeros((2, 2), np.int64), [SamplingParams()] * 2,
                    masks=masks)
    assert [c.token for c in got] == [9, V - 1, 5, V - 1]


@pytest.mark.parametrize("bits,which,message", [
    (np.zeros((1, 3), np.int64), np.zeros(1, np.int64), "token masks"),
    (np.zeros((1, 3), np.int32), np.array([1], np.int64), "outside 0-0"),
    (np.zeros((1, 3), np.int32), np.array([-2], np.int64), "outside 0-0"),
    (np.zeros(3, np.int32), np.zeros(1, np.int64), "token masks"),
])
def test_bad_masks_are_refused(bits: np.ndarray, which: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenMasks(bits, which)


def test_a_steps_masks_follow_its_rows_drafts() -> None:
    """Row 0 free with 2 drafts, row 1 constrained with 2 drafts, row 2 constrained, none."""
    a, b = Counting(10), Counting(40)
    m = token_masks([None, a, b], [[1, 2], [10, 11], []])
    assert m is not None
    assert m.which.tolist() == [-1, -1, -1, 0, 1, 2, 3]
    allowed = [m.allowed(e, V) for e in range(7)]
    assert [None if x is None else int(np.flatnonzero(x)[0]) for x in allowed] == [None, None, None, 10, 11, 12, 40]
    assert token_masks([None, None], [[1], []]) is None  # nothing constrained: the step carries nothing


class Broken(Counting):
    """A grammar that cannot say what follows: its engine raises (with its state and its whole
    text after the first line, as llguidance's do), or it allows no token at all."""

    def __init__(self, start: int, empty: bool = False) -> None:
        super().__init__(start)
        self.empty = empty

    def masks(self, drafts: list[int]) -> np.ndarray:
        self.calls += 1
        if self.empty:
            return np.zeros((len(drafts) + 1, mask_words(V)), np.int32)
        raise ValueError("NoExtensionBias\n<state>...</state><grammar>root ::= SECRET</grammar>")


def test_a_row_whose_grammar_fails_fails_alone() -> None:
    """Issue 54: one row's grammar error, or a mask that allows nothing, is that row's `failure`
    (a reason in a line); its entries go free and every other row's masks are as without it."""
    a, b = Counting(10), Counting(40)
    want = token_masks([a, None, b], [[10], [1], []])
    for bad in (Broken(5), Broken(5, empty=True)):
        a, b = Counting(10), Counting(40)
        m = token_masks([a, bad, None, b], [[10], [5, 6], [1], []])
        assert m is not None and want is not None
        assert m.which.tolist() == [0, 1, -1, -1, -1, -1, -1, 2]  # the broken row's 3 entries free
        assert np.array_equal(m.bits, want.bits)
        assert bad.failure in ("NoExtensionBias", "the grammar allows no token here: no output can satisfy it")
        assert a.failure is None and b.failure is None
        assert token_masks([bad], [[]]) is None and bad.calls == 1  # a failed grammar is not asked again


def test_an_entry_that_cannot_be_sampled_fails_alone() -> None:
    """Logits that are not finite, or a mask that allows nothing, make entry e a failed Choice;
    the others are chosen as they would be alone."""
    logits = np.tile(np.arange(V, dtype=np.float32), (3, 1, 1))  # [B=3, N=1, V]
    logits[1, 0, 7] = np.nan
    masks = TokenMasks(np.stack([bits_of([5]), np.zeros(mask_words(V), np.int32)]), np.array([0, -1, 1], np.int64))
    at = np.array([[0, 0], [1, 0], [2, 0]], np.int64)
    got = choose_at(logits, at, np.zeros(3, np.int64), np.zeros((3, 1), np.int64), [SamplingParams()] * 3,
                    masks=masks)
    assert [(c.token, c.why) for c in got] == [(5, ""), (-1, "the logits are not finite"),
                                               (-1, "its token mask allows no token")]


def test_drafts_are_cut_where_the_grammar_ends_them() -> None:
    c = Counting(10)
    q = np.ones((3, 2), np.float32) / 2
    cut = within_grammar(c, Proposal([10, 11, 99], np.zeros((3, 2), np.int64), q))
    assert cut.tokens == [10, 11] and cut.q_ids is not None and cut.q_ids.shape == (2, 2)
    assert cut.q_probs is not None and cut.q_probs.shape == (2, 2)
    assert within_grammar(c, Proposal([99])).tokens == []
    whole = Proposal([10, 11])
    assert within_grammar(c, whole) is whole and within_grammar(None, whole) is whole


def test_late_masks_are_computed_once_by_whoever_asks_first() -> None:
    import threading

    from shardline.decoding.masks import LateMasks
    from shardline.serving.constrained import late_masks

    assert late_masks([None, None], [[], []]) is None  # free rows carry nothing
    grammar = Counting(5)
    late = late_masks([grammar, None], [[], [1]])
    assert isinstance(late, LateMasks) and grammar.calls == 0  # not at planning: later, beside the step
    got: list[TokenMasks | None] = []
    threads = [threading.Thread(target=lambda: got.append(late.get())) for _ in range(4)]
    for t in threads:
        t.start()
    late.prepare()
    for t in threads:
        t.join()
    assert grammar.calls == 1 and all(g is got[0] for g in got)
    assert got[0] is not None and got[0].which.tolist() == [0, -1, -1]


def test_a_late_mask_that_fails_fails_where_the_step_samples() -> None:
    from shardline.decoding.masks import LateMasks

    def broken() -> TokenMasks | None:
        raise ValueError("the grammar is in an error state")

    late = LateMasks(broken)
    late.prepare()  # the engine's call: nothing raised there
    with pytest.raises(ValueError, match="error state"):
        late.get()  # the sampler's: the step's rows fail with the reason


def test_late_masks_are_checked_at_sampling() -> None:
    from shardline.decoding.masks import LateMasks
    from shardline.errors import StepRefused
    from shardline.stage.cache import StepInputs
    from shardline.stage.executor import sample
    from shardline.stage.work import StageWork

    inputs = StepInputs(np.zeros((1, 1), np.int64), np.ones((1, 3), np.int64), np.array([[2]]))
    logits = np.zeros((1, 1, V), np.float32)

    def work(bits: np.ndarray) -> StageWork:
        late = LateMasks(lambda: TokenMasks(bits, np.array([0])))
        return StageWork(0, inputs, np.array([[0, 0]]), [SamplingParams()], masks=late)

    assert [c.token for c in sample(work(bits_of([42])[None]), logits)] == [42]
    with pytest.raises(StepRefused, match="allows no token"):
        sample(work(np.zeros((1, mask_words(V)), np.int32)), logits)
    with pytest.raises(StepRefused, match="token masks of 2 words for a vocabulary of 70"):
        sample(work(np.full((1, 2), -1, np.int32)), logits)


def test_a_grammar_is_logged_by_a_prefix_and_a_hash() -> None:
    """Issue 54 point 2: a client's grammar may be 256 KiB and carry anything; a log line names it
    by its kind, 40 characters and a hash, the same for the same text."""
    from shardline.model.grammar import GrammarSpec

    text = "root ::= " + "x" * 100 + "SECRET"
    label = GrammarSpec("gbnf", text).label()
    assert label.startswith("gbnf 'root ::= xxx") and "SECRET" not in label and f"({len(text)} chars" in label
    assert label == GrammarSpec("gbnf", text).label() != GrammarSpec("gbnf", text + " ").label()
