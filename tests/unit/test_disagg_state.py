"""The control plane's vocabulary: validated ranges, buckets, loads and the cluster state."""

from __future__ import annotations

import pytest

from shardline.disagg.policies import least_loaded_prefill
from shardline.disagg.state import (
    ClusterState,
    DecodeLoad,
    LengthRange,
    Load,
    PrefillLoad,
    bucket,
    sent_decode,
    sent_prefill,
)
from shardline.errors import ShardlineError


def test_length_range_contains_its_half_open_span() -> None:
    r = LengthRange(100, 200)
    assert 100 in r and 199 in r and 200 not in r and 99 not in r
    assert 10**9 in LengthRange(400)


@pytest.mark.parametrize(("lo", "hi"), [(-1, 10), (5, 5), (6, 5)])
def test_length_range_invalid(lo: int, hi: int) -> None:
    with pytest.raises(ShardlineError, match=r"a length range needs 0 <= lo < hi"):
        LengthRange(lo, hi)


def test_bucket_half_open_and_the_last_open() -> None:
    assert bucket(0, 50, 4) == LengthRange(0, 50)
    assert bucket(49, 50, 4) == LengthRange(0, 50)
    assert bucket(50, 50, 4) == LengthRange(50, 100)
    assert bucket(149, 50, 4) == LengthRange(100, 150)
    assert bucket(150, 50, 4) == LengthRange(150)  # the last of 4 buckets holds 150 and on
    assert bucket(10_000, 50, 4) == LengthRange(150)
    assert bucket(7, 50, 1) == LengthRange(0)


@pytest.mark.parametrize(("tokens", "g", "buckets"), [(-1, 50, 4), (1, 0, 4), (1, 50, 0)])
def test_bucket_invalid(tokens: int, g: int, buckets: int) -> None:
    with pytest.raises(ShardlineError, match="bucket needs tokens >= 0, g >= 1 and buckets >= 1"):
        bucket(tokens, g, buckets)


def test_prefill_load_validated() -> None:
    assert PrefillLoad(0, 0, False).queued == 0
    with pytest.raises(ShardlineError, match="prefill load counts must be >= 0"):
        PrefillLoad(-1, 0, False)
    with pytest.raises(ShardlineError, match="12 queued prompt tokens but no queued request"):
        PrefillLoad(0, 12, True)


def test_decode_load_free_and_validated() -> None:
    assert DecodeLoad(running=3, heavy=1, light=2, used=300, total=1000, queued=0).free == 700
    with pytest.raises(ShardlineError, match=r"heavy \+ light streams must be the running streams"):
        DecodeLoad(running=3, heavy=1, light=1, used=0, total=10, queued=0)
    with pytest.raises(ShardlineError, match="KV slots: need 0 <= used <= total"):
        DecodeLoad(running=0, heavy=0, light=0, used=11, total=10, queued=0)
    with pytest.raises(ShardlineError, match="KV slots"):
        DecodeLoad(running=0, heavy=0, light=0, used=0, total=0, queued=0)
    with pytest.raises(ShardlineError, match="decode load counts must be >= 0"):
        DecodeLoad(running=0, heavy=0, light=0, used=0, total=10, queued=-1)


def test_cluster_state_splits_roles_and_is_read_only() -> None:
    p, d = PrefillLoad(1, 10, True), DecodeLoad(0, 0, 0, 0, 100, 0)
    source: dict[str, Load] = {"p0": p, "d0": d}
    state = ClusterState(source)
    source["p1"] = p  # the caller's dict changing later does not change the state
    assert state.prefill() == {"p0": p}
    assert state.decode() == {"d0": d}
    with pytest.raises(TypeError):
        state.loads["p2"] = p  # type: ignore[index]


def test_cluster_state_invalid() -> None:
    with pytest.raises(ShardlineError, match="instance '' needs a name"):
        ClusterState({"": PrefillLoad(0, 0, False)})
    with pytest.raises(ShardlineError, match="instance 'x' needs a name and a prefill or decode load"):
        ClusterState({"x": 3})  # type: ignore[dict-item]


def test_sent_prefill_counts_a_request_until_the_next_reading() -> None:
    state = ClusterState({"p0": PrefillLoad(0, 0, False), "p1": PrefillLoad(1, 50, True),
                          "d0": DecodeLoad(0, 0, 0, 0, 100, 0)})
    after = sent_prefill(state, "p0", 80)
    assert after.loads["p0"] == PrefillLoad(1, 80, False)
    assert after.loads["p1"] is state.loads["p1"] and state.loads["p0"] == PrefillLoad(0, 0, False)
    # a burst inside one period spreads: the least-loaded instance changes as requests are counted
    assert least_loaded_prefill(state) == "p0" and least_loaded_prefill(after) == "p1"


def test_sent_decode_counts_a_stream_and_its_predicted_slots() -> None:
    state = ClusterState({"d0": DecodeLoad(1, 0, 1, 30, 100, 0), "p0": PrefillLoad(0, 0, False)})
    after = sent_decode(state, "d0", 90, heavy=True)
    assert after.loads["d0"] == DecodeLoad(2, 1, 1, 100, 100, 1)  # used capped at the total
    assert sent_decode(state, "d0", 5, heavy=False).loads["d0"] == DecodeLoad(2, 0, 2, 35, 100, 1)


@pytest.mark.parametrize("name, tokens", [("d0", 5), ("nowhere", 5), ("p0", 0)])
def test_sent_prefill_invalid(name: str, tokens: int) -> None:
    state = ClusterState({"p0": PrefillLoad(0, 0, False), "d0": DecodeLoad(0, 0, 0, 0, 100, 0)})
    with pytest.raises(ShardlineError, match="cannot count a request"):
        sent_prefill(state, name, tokens)


@pytest.mark.parametrize("name, tokens", [("p0", 5), ("nowhere", 5), ("d0", 0)])
def test_sent_decode_invalid(name: str, tokens: int) -> None:
    state = ClusterState({"p0": PrefillLoad(0, 0, False), "d0": DecodeLoad(0, 0, 0, 0, 100, 0)})
    with pytest.raises(ShardlineError, match="cannot count a stream"):
        sent_decode(state, name, tokens, heavy=False)
