"""Placement by memory: proportional splits, rounding, the one-layer minimum, grouping an
existing export's stages, and `--plan` overrides (no Ray: plain numbers)."""

from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest

from shardline.cluster.placement import (
    GIB,
    Participant,
    align_to_stages,
    apportion,
    group_stages,
    parse_plan,
    place,
    split_by_memory,
)
from shardline.errors import ShardlineError

FOUR_STAGES = [(0, 7), (8, 14), (15, 22), (23, 29)]


def _people(*gib: float) -> list[Participant]:
    """The coordinator, then nodes a, b, c... with the given memories."""
    names = "abcdefgh"
    return [Participant("coordinator", int(gib[0] * GIB))] + [
        Participant(names[i], int(m * GIB), f"{names[i] * 8}0123") for i, m in enumerate(gib[1:])]


def test_split_is_proportional_to_memory() -> None:
    assert split_by_memory(30, [1, 1, 2, 2]) == [(0, 4), (5, 9), (10, 19), (20, 29)]
    assert split_by_memory(30, [GIB, GIB, 2 * GIB, 2 * GIB]) == split_by_memory(30, [1, 1, 2, 2])
    assert split_by_memory(30, [7]) == [(0, 29)]


def test_largest_remainder_rounding_ties_to_the_earlier_participant() -> None:
    # quotas 19.41, 3.53, 7.06: floors 19 + 3 + 7 = 29, the largest remainder (3.53) gets the last layer
    assert apportion(30, [22, 4, 8]) == [19, 4, 7]
    # quotas 7.5, 7.5, 15: one layer left, two equal remainders
    assert apportion(30, [1, 1, 2]) == [8, 7, 15]


def test_every_participant_gets_at_least_one_layer() -> None:
    assert split_by_memory(5, [100, 1, 1, 1]) == [(0, 1), (2, 2), (3, 3), (4, 4)]
    assert apportion(4, [1, 1, 1, 1]) == [1, 1, 1, 1]


def test_splits_are_complete_and_within_a_layer_of_the_quota() -> None:
    rng = random.Random(3)
    for _ in range(300):
        n_layers = rng.randint(1, 80)
        memories = [rng.randint(1, 64) * GIB // 4 for _ in range(rng.randint(1, min(n_layers, 9)))]
        ranges = split_by_memory(n_layers, memories)
        assert ranges == split_by_memory(n_layers, memories)  # deterministic
        assert ranges[0][0] == 0 and ranges[-1][1] == n_layers - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        for (first, last), m in zip(ranges, memories, strict=True):
            quota = Fraction(n_layers * m, sum(memories))
            assert last >= first and (quota < 1 or abs(last - first + 1 - quota) < 1)


def test_more_participants_than_layers_is_refused() -> None:
    with pytest.raises(ShardlineError) as e:
        split_by_memory(3, [1, 1, 1, 1])
    assert str(e.value) == ("cannot place 3 layers on 4 participants (the coordinator and 3 Ray nodes): "
                            "each needs at least one layer")


def test_stages_are_grouped_by_memory_on_their_boundaries() -> None:
    # 22 worker layers: 1:2 wants 7.3 and 14.7 -> stage 1 (7) and stages 2-3 (15)
    assert group_stages(FOUR_STAGES, [GIB, GIB, 2 * GIB]) == [(0, 0), (1, 1), (2, 3)]
    assert group_stages(FOUR_STAGES, [GIB, 2 * GIB, GIB]) == [(0, 0), (1, 2), (3, 3)]
    assert group_stages(FOUR_STAGES, [1, 1, 1, 1]) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert group_stages(FOUR_STAGES, [1, 5]) == [(0, 0), (1, 3)]
    # the coordinator keeps stage 0 whatever its memory: it is the one that runs stage 0
    assert group_stages(FOUR_STAGES, [100, 1, 1]) == group_stages(FOUR_STAGES, [1, 1, 1])


def test_grouping_needs_a_stage_per_node() -> None:
    with pytest.raises(ShardlineError) as e:
        group_stages([(0, 14), (15, 29)], [1, 1, 1])
    assert str(e.value) == ("the export has 2 stages: stage 0 stays on the coordinator, which leaves 1 for 2 "
                            "Ray nodes: export at least 3 stages, or leave out --shards")


def test_plan_override() -> None:
    assert parse_plan("0-9,10-19,20-29", 30, 3) == [(0, 9), (10, 19), (20, 29)]


@pytest.mark.parametrize("spec,message", [
    ("0-9,10-29", "--plan '0-9,10-29' has 2 ranges but there are 3 participants (the coordinator and 2 Ray nodes)"),
    ("0-9,12-19,20-29", "--plan '0-9,12-19,20-29' is not contiguous: expected a range starting at 10"),
    ("0-9,10-19,20-28", "--plan '0-9,10-19,20-28' covers layers 0-28 but the model has 30"),
    ("0-9,10-x,20-29", "bad layer range '10-x' in --plan '0-9,10-x,20-29' (expected A-B)"),
])
def test_bad_plan_overrides(spec: str, message: str) -> None:
    with pytest.raises(ShardlineError, match=f"^{re.escape(message)}$"):
        parse_plan(spec, 30, 3)


def test_override_on_an_export_must_follow_its_stages() -> None:
    assert align_to_stages([(0, 7), (8, 22), (23, 29)], FOUR_STAGES) == [(0, 0), (1, 2), (3, 3)]
    with pytest.raises(ShardlineError) as e:
        align_to_stages([(0, 7), (8, 20), (21, 29)], FOUR_STAGES)
    assert str(e.value) == ("--plan range 8-20 does not end on a stage boundary of the export "
                            "(its stages end at layers 7, 14, 22, 29)")
    with pytest.raises(ShardlineError) as e:
        align_to_stages([(0, 14), (15, 29)], FOUR_STAGES)
    assert str(e.value) == ("--plan gives the coordinator layers 0-14, but it runs only stage 0 of the export "
                            "(layers 0-7)")


def test_place_by_memory_and_the_printed_plan() -> None:
    plan = place(_people(1, 1, 2), 30)
    assert [a.layers for a in plan.assignments] == [(0, 7), (8, 14), (15, 29)]
    assert [a.stages for a in plan.assignments] == [(0, 0), (1, 1), (2, 2)]
    assert plan.spec == "0-7,8-14,15-29"
    assert [a.participant.name for a in plan.workers] == ["a", "b"]
    assert plan.describe() == "\n".join([
        "plan: 30 layers on the coordinator and 2 Ray nodes, by available memory (override with --plan 0-7,8-14,15-29)",
        "  coordinator        layers 0-7     ( 8)  stage 0       1.0 GiB available  on CPU",
        "  node a (aaaaaaaa)  layers 8-14    ( 7)  stage 1       1.0 GiB available  on CPU",
        "  node b (bbbbbbbb)  layers 15-29   (15)  stage 2       2.0 GiB available  on CPU",
    ])


def test_place_on_an_export_and_with_an_override() -> None:
    on_export = place(_people(1, 1, 2), 30, FOUR_STAGES)
    assert [(a.layers, a.stages) for a in on_export.workers] == [((8, 14), (1, 1)), ((15, 29), (2, 3))]
    assert "on the export's stage boundaries" in on_export.describe()
    given = place(_people(1, 1, 2), 30, None, "0-9,10-19,20-29")
    assert given.spec == "0-9,10-19,20-29"
    assert given.describe().splitlines()[0] == "plan: 30 layers on the coordinator and 2 Ray nodes, as given by --plan"
    given_on_export = place(_people(1, 1, 2), 30, FOUR_STAGES, "0-7,8-22,23-29")
    assert [a.stages for a in given_on_export.assignments] == [(0, 0), (1, 2), (3, 3)]


def test_each_stage_gets_its_device_and_the_plan_shows_it() -> None:
    plan = place(_people(1, 1, 2), 30, FOUR_STAGES)  # coordinator: stage 0; a: stage 1; b: stages 2-3
    one = plan.on_devices(("GPU.1",))
    assert [a.devices for a in one.assignments] == [("GPU.1",), ("GPU.1",), ("GPU.1", "GPU.1")]
    assert [a.device for a in one.assignments] == ["GPU.1", "GPU.1", "GPU.1"]
    mixed = plan.on_devices(("CPU", "GPU", "CPU", "NPU"))
    assert [a.device for a in mixed.assignments] == ["CPU", "GPU", "CPU,NPU"]
    assert [line.rsplit("  on ", 1)[1] for line in mixed.describe().splitlines()[1:]] == ["CPU", "GPU", "CPU,NPU"]
    assert [a.layers for a in mixed.assignments] == [a.layers for a in plan.assignments]
    with pytest.raises(ShardlineError, match=r"^--device names 2 devices \(CPU,NPU\) for the 4 stages of this "
                                             r"plan: give one device, or one per stage$"):
        plan.on_devices(("CPU", "NPU"))


def test_place_refuses_nodes_without_memory_and_an_empty_cluster() -> None:
    with pytest.raises(ShardlineError, match=r"^node b \(bbbbbbbb\) reports no available memory$"):
        place(_people(1, 1, 0), 30)
    with pytest.raises(ShardlineError, match=r"^no Ray node to place stage workers on \(the cluster has no alive "
                                             r"node with a CPU\)$"):
        place(_people(1), 30)
