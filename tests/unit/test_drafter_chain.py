"""A model drafter's bookkeeping (stage/draft_model.ModelDrafter) over a fake one-stage model
whose next token is a function of exactly the tokens its mask lets it attend, at exactly their
positions: after any run of proposals, drafts drawn ahead, accepts, rejects, target tokens that
match the guess or not, and compactions, every proposal is the model's greedy continuation of
the accepted text, and drafts drawn ahead are offered without another call of the model."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from shardline.config import COMPACT_AT, SamplingParams
from shardline.stage.cache import StepInputs
from shardline.stage.draft_model import KeyedKv, ModelDrafter

VOCAB = 23


def successor(attended: list[tuple[int, int]]) -> int:
    """The fake model's next token after (token, position) pairs: depends on all of them."""
    return hash(tuple(attended)) % VOCAB


@dataclass
class FakeRunner:
    slots: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # key -> (token, position) per slot
    calls: int = 0

    def open(self, key: int) -> None:
        self.slots[key] = []

    def close(self, key: int) -> None:
        self.slots.pop(key, None)

    def run(self, key: int, inputs: StepInputs) -> np.ndarray:
        self.calls += 1
        held = self.slots[key]
        held += list(zip(inputs.input_ids[0].tolist(), inputs.position_ids[0].tolist(), strict=True))
        mask = inputs.attention_mask[0]
        assert mask.shape[0] == len(held)
        attended = [held[i] for i in np.flatnonzero(mask)]
        assert [p for _, p in attended] == list(range(len(attended))), "positions are logical and contiguous"
        logits = np.zeros((1, inputs.new_tokens, VOCAB), np.float32)
        logits[0, -1, successor(attended)] = 1.0
        return logits

    def compact(self, key: int, index: np.ndarray, slots: int) -> None:
        assert slots == len(self.slots[key])
        self.slots[key] = [self.slots[key][i] for i in index[0].tolist()]


@dataclass
class FakeModel:
    runner: FakeRunner = field(default_factory=FakeRunner)
    lock: threading.Lock = field(default_factory=threading.Lock)
    token_s: float = 0.001

    def kv(self, key: int) -> KeyedKv:
        return KeyedKv(self, key)  # type: ignore[arg-type]  # a fake of DraftModel's keyed side


def greedy_continuation(context: list[int], k: int) -> list[int]:
    text = list(context)
    for _ in range(k):
        text.append(successor([(t, p) for p, t in enumerate(text)]))
    return text[len(context):]


def test_every_proposal_continues_the_accepted_text_and_drafts_ahead_cost_nothing() -> None:
    rng = np.random.default_rng(7)
    model = FakeModel()
    drafter = ModelDrafter(model, 1)  # type: ignore[arg-type]
    greedy = SamplingParams()
    context = [int(t) for t in rng.integers(0, VOCAB, 9)]
    free = compactions = 0
    for _ in range(400):
        k = int(rng.integers(0, 6))
        ready = drafter.ready(context)
        before = model.runner.calls
        slots = len(model.runner.slots[1])
        proposal = drafter.propose(context, k, greedy).tokens if k else []
        compactions += len(model.runner.slots[1]) < slots
        assert proposal == greedy_continuation(context, k)
        if k and ready >= k and drafter.kv.book.masked < 128:
            assert model.runner.calls == before  # every draft offered was drawn ahead
            free += 1
        for _ in range(int(rng.integers(0, 6)) if k else 0):  # the step is out: draw ahead
            drafter.follow(context, greedy, k + 1 + 4)
        assert len(drafter.drafts) <= 5 + 1 + 4  # never past the limit given to `follow`
        kept = int(rng.integers(0, k + 1))
        guess = drafter.drafts[kept].token if len(drafter.drafts) > kept else None
        truth = greedy_continuation(context + proposal[:kept], 1)[0]
        # the target's own token: its choice when every draft stood (then often the drafter's
        # guess), else a correction that differs from the rejected draft
        target = truth if kept == k else (proposal[kept] + 1) % VOCAB
        if guess is not None and kept == k > 0:
            assert guess == truth  # the guess is the draft model's own continuation
        context = context + proposal[:kept] + [target]
        assert drafter.kv.book.position == drafter.fed + drafter.pending
        # what admission budgets the draft's KV (server.stream_limits, here with k_max = 5)
        assert len(model.runner.slots[1]) <= len(context) + COMPACT_AT + 2 * (2 * 5 + 1)
    assert free > 20 and compactions >= 1, (free, compactions)


def test_drafts_ahead_that_the_target_did_not_take_are_dropped() -> None:
    model = FakeModel()
    drafter = ModelDrafter(model, 1)  # type: ignore[arg-type]
    greedy = SamplingParams()
    context = [3, 1, 4]
    first = drafter.propose(context, 2, greedy).tokens
    while drafter.follow(context, greedy, 6):
        pass
    assert len(drafter.drafts) == 6
    assert drafter.ready(context + first + [drafter.drafts[2].token]) == 3
    other = (drafter.drafts[2].token + 1) % VOCAB
    assert drafter.ready(context + first + [other]) == 0
    context = context + first + [other]
    assert drafter.propose(context, 3, greedy).tokens == greedy_continuation(context, 3)
    held = model.runner.slots[1]
    assert len(held) - drafter.kv.book.masked == len(context) + 2  # the text, then two drafts fed


def test_a_drafter_that_offered_nothing_catches_up_in_idle_time() -> None:
    model = FakeModel()
    drafter = ModelDrafter(model, 1)  # type: ignore[arg-type]
    greedy = SamplingParams()
    context = [3, 1, 4]
    drafter.propose(context, 1, greedy)
    context = context + [1, 5, 9]  # three plain steps: no proposals, the drafter fell behind
    assert drafter.ready(context) == 0
    assert drafter.follow(context, greedy, 4) and drafter.fed == len(context)  # caught up
    while drafter.follow(context, greedy, 4):
        pass
    guess = drafter.drafts[0].token
    assert guess == greedy_continuation(context, 1)[0] and drafter.ready(context + [guess]) == 3
    calls = model.runner.calls
    assert drafter.propose(context + [guess], 3, greedy).tokens == greedy_continuation(context + [guess], 3)
    assert model.runner.calls == calls  # drawn while the step was out
