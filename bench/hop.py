"""The transport alone: what one hop costs with the real codec and Link, no graph in the way.

Two spawned processes on loopback. The client sends a decode step's Forward frame (f16 hidden
state of the default model, a mask of SLOTS slots, one hops row); the echo process decodes it and
encodes it again, stamped, back to the client, as a worker encodes its frame down the chain.
A round trip is two hops: encode, socket, decode, twice. Per hop = round trip / 2.
What a worker does between receiving and sending (its graph, building its output frame) is
not transport: the pipeline's per-token breakdown reports it as worker host time.

Also the mask's bytes per hop at 4096 columns (issue 9): runs of ones (protocol 4) against the
u8 row protocol 3 sent and the i64 row the graph takes, with and without holes.

Cases: each process pinned to its own core (as on two machines), both on one core (a woken
process waits for the other to yield it), each of them also under mutual TLS (issue 11: the
link's TLS transport, wire/tls.py, with credentials from `shardline keygen`), and, to split the
figure, the bare socket round trip of the same bytes and the codec alone in one process.

    python bench/hop.py                # 3000 round trips per case
    python bench/hop.py --trips 500

The last line on stdout is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardline.cluster.keygen import keygen
from shardline.config import SamplingParams
from shardline.wire import tls
from shardline.wire.codec import decode, encode
from shardline.wire.link import Link, LinkClosed, Transport
from shardline.wire.messages import HOP_COLUMNS, Forward, Phase, mask_to_runs, runs_to_mask
from shardline.wire.tls import Credentials

HIDDEN, SLOTS = 576, 200  # the default model's hidden size; a mid-conversation cache
LONG = 4096  # mask width (cached slots + the new token) of the bytes-per-hop comparison
_ARRAY_HEAD_2D = 3 + 2 * 4  # present, dtype, ndim, then two u32 dims (codec.py)


def mask_with_holes(width: int, holes: list[tuple[int, int]]) -> np.ndarray:
    """A one-row [1, width] i64 mask of ones with (start, length) holes masked out (rejected drafts)."""
    mask = np.ones((1, width), np.int64)
    for start, n in holes:
        mask[0, start : start + n] = 0
    return mask


def forward(slots: int = SLOTS, rows: int = 1, mask: np.ndarray | None = None) -> Forward:
    """A decode step's Forward of one stream: one new token over `slots` cached ones."""
    rng = np.random.default_rng(0)
    mask = np.ones((1, slots + 1), np.int64) if mask is None else mask
    width = int(mask.shape[1])
    return Forward(key=1, seq=7, phase=Phase.DECODE, first=False, slots=width, want_logits=False, compact=False,
                   sampling=[SamplingParams()], rows=np.array([1], np.int64), keep=np.array([0], np.int64),
                   merge=np.zeros(0, np.int64), hidden=rng.standard_normal((1, 1, HIDDEN)).astype(np.float16),
                   mask_runs=mask_to_runs(mask), position_ids=np.array([[width - 1]], np.int64),
                   sample_at=np.zeros((1, 2), np.int64), drafts=None, q_ids=None, q_probs=None,
                   allow_bits=None, allow_of=None,
                   hops=np.zeros((rows, len(HOP_COLUMNS)), np.float64))


def mask_bytes(holes: list[tuple[int, int]], width: int = LONG, reps: int = 2000) -> dict[str, Any]:
    """What the mask weighs in one decode step's Forward at `width` columns, three ways: runs of
    ones (protocol 4), the u8 row protocol 3 sent, the i64 row the graph takes; and the whole
    frame in each case (the same frame with only the mask array swapped: each array is a
    3 + 4 * ndim byte header and its raw bytes). Also the time to make the runs from the mask
    (coordinator) and the mask from the runs (each worker)."""
    mask = mask_with_holes(width, holes)
    runs = mask_to_runs(mask)
    frame = len(encode(forward(mask=mask), stamp=True))
    as_runs = _ARRAY_HEAD_2D + runs.nbytes
    as_u8, as_i64 = _ARRAY_HEAD_2D + width, _ARRAY_HEAD_2D + 8 * width
    t0 = time.perf_counter()
    for _ in range(reps):
        mask_to_runs(mask)
    t1 = time.perf_counter()
    for _ in range(reps):
        runs_to_mask(runs, 1, width)
    t2 = time.perf_counter()
    return {"width": width, "holes": len(holes), "runs": int(runs.shape[0]),
            "mask_bytes": {"runs (protocol 4)": as_runs, "u8 row (protocol 3)": as_u8, "i64 row (graph input)": as_i64},
            "frame_bytes": {"runs (protocol 4)": frame, "u8 row (protocol 3)": frame - as_runs + as_u8,
                            "i64 row (graph input)": frame - as_runs + as_i64},
            "mask_to_runs_us": round((t1 - t0) / reps * 1e6, 2), "runs_to_mask_us": round((t2 - t1) / reps * 1e6, 2)}


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _echo(ports: Any, cpu: int | None, raw: bool, creds: str | None) -> None:
    _pin(cpu)
    server = socket.create_server(("127.0.0.1", 0))
    ports.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport: Transport = conn if creds is None else tls.server(conn, Credentials.load(Path(creds)), 30)
    if raw:  # the same bytes back, no codec: the wire alone
        size = len(encode(forward(), stamp=True))
        buf = memoryview(bytearray(size))
        while True:
            got = 0
            while got < size:
                k = conn.recv_into(buf[got:], size - got)
                if k == 0:
                    return
                got += k
            conn.sendall(buf)
    link = Link(transport)
    while True:
        try:
            msg = link.recv()
        except LinkClosed:
            return
        assert isinstance(msg, Forward)
        # Re-encoded as it came: what a worker adds before it sends (its output, its hops row)
        # is the worker's host time in the pipeline's breakdown, not the transport's.
        link.send(msg, stamp=True)


def _client(ports: Any, results: Any, cpu: int | None, raw: bool, trips: int, max_s: float,
            creds: str | None) -> None:
    _pin(cpu)
    link = Link.connect("127.0.0.1", ports.get(timeout=30), None if creds is None else Credentials.load(Path(creds)))
    msg = forward()
    frame = encode(msg, stamp=True)
    times: list[float] = []
    deadline = time.monotonic() + max_s
    for _ in range(trips):
        if time.monotonic() > deadline:
            break
        t = time.perf_counter()
        if raw:
            link.transport.sendall(frame)
            link._read(len(frame))
        else:
            link.send(msg, stamp=True)
            reply = link.recv()
            assert isinstance(reply, Forward) and reply.seq == msg.seq
        times.append(time.perf_counter() - t)
    link.close()
    results.put(times)


def round_trips(client_cpu: int | None, echo_cpu: int | None, raw: bool = False, trips: int = 3000,
                max_s: float = 60.0, creds: tuple[str, str] | None = None) -> list[float]:
    """Round-trip seconds between two spawned processes pinned as given (None: not pinned),
    under mutual TLS with `creds` (the client's and the echo's credentials folders)."""
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    mine, theirs = creds or (None, None)
    echo = ctx.Process(target=_echo, args=(ports, echo_cpu, raw, theirs), daemon=True)
    client = ctx.Process(target=_client, args=(ports, results, client_cpu, raw, trips, max_s, mine), daemon=True)
    echo.start()
    client.start()
    try:
        times: list[float] = results.get(timeout=max_s + 60)
    finally:
        for p in (client, echo):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return times[max(1, len(times) // 20):]  # the first 5% warm up (connection, caches)


def codec_alone(n: int = 3000) -> tuple[float, float]:
    """Median encode and decode seconds of the same frame in one process."""
    msg = forward()
    frame = encode(msg, stamp=True)
    enc, dec = [], []
    for _ in range(n):
        t = time.perf_counter()
        encode(msg, stamp=True)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        decode(frame)
        dec.append(time.perf_counter() - t)
    return float(np.median(enc)), float(np.median(dec))


def measure(trips: int = 3000) -> dict[str, Any]:
    """Per-hop figures in microseconds for every case, and the codec alone."""
    cpus = sorted(os.sched_getaffinity(0))
    two = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    one = (cpus[0], cpus[0])
    keys = Path(tempfile.mkdtemp(prefix="hop-tls-")) / "cluster"
    nodes = keygen(keys, 2)
    tls_pair = (str(nodes[0]), str(nodes[1]))
    cases = {"own core each": (two, False, None), "own core each, TLS": (two, False, tls_pair),
             "one core": (one, False, None), "one core, TLS": (one, False, tls_pair),
             "socket only, own core each": (two, True, None)}
    out: dict[str, Any] = {}
    for name, ((a, b), raw, creds) in cases.items():
        hop_us = np.asarray(round_trips(a, b, raw, trips, creds=creds)) / 2 * 1e6
        out[name] = {"median_us": round(float(np.median(hop_us)), 1),
                     "p99_us": round(float(np.percentile(hop_us, 99)), 1), "trips": len(hop_us)}
    enc, dec = codec_alone()
    out["codec alone"] = {"encode_us": round(enc * 1e6, 1), "decode_us": round(dec * 1e6, 1),
                          "frame_bytes": len(encode(forward(), stamp=True))}
    return out


def print_table(figures: dict[str, Any]) -> None:
    print(f"\nper-hop transport alone (Forward of a decode step, {SLOTS}-slot mask, f16 hidden {HIDDEN}): "
          "round trip / 2, us")
    print(f"{'case':<30}{'median':>10}{'p99':>10}{'trips':>8}")
    for name, row in figures.items():
        if "median_us" in row:
            print(f"{name:<30}{row['median_us']:>10.1f}{row['p99_us']:>10.1f}{row['trips']:>8}")
    c = figures["codec alone"]
    print(f"codec alone, one process: encode {c['encode_us']:.1f} us, decode {c['decode_us']:.1f} us, "
          f"frame {c['frame_bytes']} B")


# Holes as speculation leaves them: rejected drafts masked out here and there in a long cache.
HOLES = [(1000, 3), (2200, 5), (3100, 2), (3900, 4), (4050, 1)]


def masks() -> dict[str, dict[str, Any]]:
    return {"no holes": mask_bytes([]), f"{len(HOLES)} holes": mask_bytes(HOLES)}


def print_masks(figures: dict[str, dict[str, Any]]) -> None:
    print(f"\nbytes per hop at {LONG} mask columns: a decode step's Forward (1 row, f16 hidden {HIDDEN}, "
          "one hops row); the mask array (header + data) and the whole frame")
    print(f"{'mask':<10}{'sent as':<24}{'runs':>6}{'mask B':>9}{'frame B':>9}{'frame / runs':>14}")
    for name, m in figures.items():
        base = m["frame_bytes"]["runs (protocol 4)"]
        for way, size in m["mask_bytes"].items():
            frame = m["frame_bytes"][way]
            print(f"{name:<10}{way:<24}{m['runs']:>6}{size:>9}{frame:>9}{frame / base:>14.2f}")
    for name, m in figures.items():
        print(f"{name}: mask -> runs {m['mask_to_runs_us']:.1f} us (coordinator), runs -> i64 mask "
              f"{m['runs_to_mask_us']:.1f} us (each worker)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trips", type=int, default=3000)
    args = p.parse_args()
    mask_figures = masks()
    figures = measure(args.trips)
    print_table(figures)
    print_masks(mask_figures)
    own = figures["own core each"]["median_us"]
    plain = mask_figures["no holes"]["frame_bytes"]
    ratios = {"tls_vs_clear_own_core": round(figures["own core each, TLS"]["median_us"] / own, 2),
              "tls_vs_clear_one_core": round(figures["one core, TLS"]["median_us"]
                                             / figures["one core"]["median_us"], 2),
              "frame_u8_vs_runs_4096": round(plain["u8 row (protocol 3)"] / plain["runs (protocol 4)"], 2),
              "frame_i64_vs_runs_4096": round(plain["i64 row (graph input)"] / plain["runs (protocol 4)"], 2)}
    print(json.dumps({**ratios, "hop_us_median_own_core": own, "target_us": 100,
                      "load_avg_1m": round(os.getloadavg()[0], 2), **figures, "mask_bytes_4096": mask_figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
