"""What the fleet page says (api/fleet.py), from readings alone: each run of stages with its
layers, place, precision and health; graph time per token from the last decode steps; wire
time per hop; tokens per second over the window; speculation's acceptance."""

from __future__ import annotations

from dataclasses import replace

from shardline.api.fleet import WINDOW_S, Readings, fleet_state
from shardline.serving.status import Placed, Timing


def _decode(graph: dict[int, float], wire: float) -> Timing:
    return Timing("decode", sum(graph.values()) + wire, graph, 0.0, 0.0, 0.0, 0.0, wire)


BASE = Readings(
    model="m", precision="exact", weights="gguf", status="ok", error="", active_streams=2, waiting=1, max_streams=8,
    decode_groups=1,
    placement=[Placed(0, 9, "this process", device="CPU"), Placed(10, 19, "127.0.0.1:7001", device="NPU"),
               Placed(20, 29, "127.0.0.1:7002")],
    stage_layers=[(0, 9), (10, 19), (20, 29)],
    # two decode steps of 2 rows, 1 s apart; a prefill step that must not count
    steps=[(100.0, _decode({0: 0.004, 1: 0.006, 2: 0.008}, 0.002), 2),
           (101.0, _decode({0: 0.004, 1: 0.006, 2: 0.008}, 0.004), 2),
           (101.5, Timing("prefill", 0.5, {0: 0.1, 1: 0.2, 2: 0.2}, 0, 0, 0, 0, 0.0), 1)],
    now=102.0, drafted=10, accepted=7, rss_bytes=512 * 2**20, kv_slots=2048, kv_token_bytes_per_layer=1024)


def test_the_chain_its_health_and_recent_figures() -> None:
    f = fleet_state(BASE)
    assert [(s["where"], s["layers"], s["health"]) for s in f["stages"]] == [
        ("this process", [0, 9], "up"), ("127.0.0.1:7001", [10, 19], "up"), ("127.0.0.1:7002", [20, 29], "up")]
    assert [s["precision"] for s in f["stages"]] == ["gguf, exact", "gguf", "gguf"]
    assert [s["device"] for s in f["stages"]] == ["CPU", "NPU", None]  # None: a worker that does not say
    # graph per token: 2 steps x stage time / 4 tokens
    assert [s["graph_ms_per_token"] for s in f["stages"]] == [2.0, 3.0, 4.0]
    assert [(h["from"], h["to"], h["wire_ms"]) for h in f["hops"]] == [(0, 1, 1.5), (1, 2, 1.5)]  # 3 ms / 2 hops
    assert f["tokens_per_s"] == 2.0  # 4 tokens since the first decode step, 2 s ago
    assert f["streams"] == {"active": 2, "waiting": 1, "max": 8, "decode_groups": 1}
    assert f["speculation"] == {"drafted": 10, "accepted": 7, "acceptance": 0.7}
    assert (f["memory_mb"], f["status"], f["window_s"]) == (512.0, "ok", WINDOW_S)
    assert [s["kv_mb"] for s in f["stages"]] == [20.0, 20.0, 20.0]  # 2048 slots x 10 layers x 1 KiB


def test_a_worker_that_runs_two_stages_gets_both_stages_graph_time() -> None:
    two = replace(BASE, placement=[Placed(0, 9, "this process"), Placed(10, 29, "127.0.0.1:7001")])
    f = fleet_state(two)
    assert [s["graph_ms_per_token"] for s in f["stages"]] == [2.0, 7.0]
    assert [(h["from"], h["to"]) for h in f["hops"]] == [(0, 1)]


def test_a_dead_worker_and_an_idle_server() -> None:
    why = "lost worker 127.0.0.1:7002: the connection closed"
    down = replace(BASE, placement=[*BASE.placement[:2], Placed(20, 29, "127.0.0.1:7002", False, why)], steps=[],
                   drafted=0, accepted=0)
    f = fleet_state(down)
    assert [(s["health"], s["why"]) for s in f["stages"]] == [("up", ""), ("up", ""), ("down", why)]
    assert all(s["graph_ms_per_token"] is None for s in f["stages"]) and f["tokens_per_s"] == 0.0
    assert all(h["wire_ms"] is None for h in f["hops"]) and f["speculation"]["acceptance"] is None
    alone = fleet_state(replace(BASE, placement=[Placed(0, 29, "this process")], stage_layers=[(0, 29)]))
    assert alone["hops"] == [] and alone["stages"][0]["graph_ms_per_token"] == 2.0  # its one stage: key 0


def test_prefill_holding_decoding_streams_back_is_said() -> None:
    """BASE: 0.5 s of prefill graph time against 0.036 s of decode, while streams decode."""
    f = fleet_state(BASE)
    assert f["prefill"] == {"share": 0.933, "holding_decode": True, "prefill_s": 0.5, "decode_s": 0.036}
    light = fleet_state(replace(BASE, steps=BASE.steps[:2] + [(101.5, Timing("prefill", 0.01, {0: 0.01}, 0, 0, 0,
                                                                                         0, 0.0), 1)]))
    assert light["prefill"]["holding_decode"] is False and light["prefill"]["share"] == round(0.01 / 0.046, 3)
    alone = fleet_state(replace(BASE, steps=[BASE.steps[2]]))  # prompts only: nothing decodes, nothing held
    assert alone["prefill"] == {"share": 1.0, "holding_decode": False, "prefill_s": 0.5, "decode_s": 0.0}


def test_a_paged_pool_s_kv_is_its_blocks_held() -> None:
    """On the paged runner the streams hold blocks, not slots (kv_slots stays 0): a stage's KV is
    the bytes of the blocks held, shared out by layers (the audit of issue 54 found it 0)."""
    paged = replace(BASE, kv_slots=0, kv_bytes=30 * 2**20,
                    placement=[Placed(0, 9, "this process"), Placed(10, 29, "127.0.0.1:7001")])
    assert [s["kv_mb"] for s in fleet_state(paged)["stages"]] == [10.0, 20.0]
    assert [s["kv_mb"] for s in fleet_state(replace(paged, kv_bytes=0))["stages"]] == [0.0, 0.0]
