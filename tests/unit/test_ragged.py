"""One paged step's packing (issue 41), pure: decode tokens first and whole, prompt chunks in the
budget left, oldest first; a zero budget is a clear error."""

from __future__ import annotations

import pytest

from shardline.errors import ShardlineError
from shardline.serving.ragged import Budget, Want, pack


def test_decodes_go_whole_then_prompts_fill_the_budget_oldest_first() -> None:
    wants = [Want(1, 3000, False), Want(2, 1, True), Want(3, 4, True), Want(4, 100, False)]
    assert pack(wants, Budget(256)) == [(2, 1), (3, 4), (1, 251)]
    assert pack(wants, Budget(5000)) == [(2, 1), (3, 4), (1, 3000), (4, 100)]


def test_decodes_over_the_budget_still_run_and_prompts_wait() -> None:
    wants = [Want(1, 50, False), *(Want(i, 5, True) for i in range(2, 6))]
    assert pack(wants, Budget(16)) == [(2, 5), (3, 5), (4, 5), (5, 5)]


def test_nothing_to_run_packs_nothing() -> None:
    assert pack([Want(1, 0, False), Want(2, 0, True)], Budget(8)) == []


@pytest.mark.parametrize("tokens", [0, -4])
def test_a_budget_of_no_tokens_is_a_clear_error(tokens: int) -> None:
    with pytest.raises(ShardlineError, match="at least 1 token"):
        Budget(tokens)
