"""Nothing a peer sends stops a worker (issue 9, item 6), through live workers on loopback.

A hand-driven peer (`Peer`) speaks the protocol to real `shardline worker` processes (or, where
the test must set small timeouts or look inside, to an in-process StageWorker listening on
127.0.0.1): fuzzed frames after a valid coordinator handshake, steps that do not fit the state,
messages that have no business on a link, Routes that lead nowhere, pre-handshake abuse, file
descriptors running out, a peer that stops reading, and sessions claimed twice or unknown. Each
test asserts what the peer gets (the reply and its reason, the link closed or not), what the
worker logged (a one-line warning naming the link, never a Python traceback), and that the
worker process is alive and still gives a real RemotePipeline the tokens it gave before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardline.config import RunConfig, SamplingParams
from shardline.errors import Unsampleable
from shardline.model.context import run_context
from shardline.model.manifest import Manifest, load_manifest
from shardline.node import worker as worker_module
from shardline.node.worker import StageWorker
from shardline.pipeline.plan import decode, prefill, run
from shardline.pipeline.remote import RemotePipeline
from shardline.stage.cache import KVBook
from shardline.wire.codec import HEADER, MAGIC, WireError, encode
from shardline.wire.codec import decode as decode_frame
from shardline.wire.hops import no_hops
from shardline.wire.link import Link, LinkClosed, Refused, TimedOut, client_handshake
from shardline.wire.messages import (
    MAX_SLOTS,
    MESSAGES,
    PROTOCOL,
    Activations,
    Forward,
    Hello,
    Message,
    Phase,
    Refuse,
    Release,
    Role,
    Route,
    Sampled,
    ShardChunk,
    ShardRequest,
    StepFailed,
    mask_to_runs,
)
from tests.helpers import GREEDY, ok
from tests.multiproc.procs import Proc, worker
from tests.unit.test_wire import SAMPLES, array_bytes, frame, rebuild, split
from tests.unit.test_wire_fuzz import _forward_out_of_range, _wrong_arrays, _wrong_fields

PROMPT = [1, 9038, 2114, 314, 260, 3575, 282, 4649, 47, 2]  # any ids of the vocabulary will do
N_NEW = 8
WAIT_S = 30.0  # the longest a peer waits for a reply that should come (a bound, not an expectation)

# --- fixtures: the export, two live workers, the tokens they give before any abuse ---------------


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("fp32", stages=3)


@pytest.fixture(scope="module")
def manifest(three: Path) -> Manifest:
    return load_manifest(three)


@pytest.fixture(scope="module")
def chain(three: Path) -> Iterator[list[Proc]]:
    """`shardline worker` processes for stages 1 and 2, shared by the tests of this file."""
    ws = [worker(three, "1")]
    try:
        ws.append(worker(three, "2"))
        yield ws
    finally:
        for w in ws:
            w.stop()


def _tokens(three: Path, addrs: list[str]) -> list[int]:
    """N_NEW greedy tokens of PROMPT through a real RemotePipeline over `addrs`."""
    remote = RemotePipeline(three, addrs, RunConfig(), "f32")
    try:
        return _tokens_through(remote)
    finally:
        remote.shutdown()


def _tokens_through(remote: RemotePipeline) -> list[int]:
    key, book = 7, KVBook()
    (out,) = ok(run(remote, prefill(key, book, PROMPT, GREEDY, first=True, last=True), timeout=WAIT_S))
    tokens = [out.choices[0].token]
    for _ in range(N_NEW - 1):
        (out,) = ok(run(remote, decode(key, book, [tokens[-1]], GREEDY), timeout=WAIT_S))
        tokens.append(out.choices[0].token)
    remote.release(key)
    return tokens


@pytest.fixture(scope="module")
def before(three: Path, chain: list[Proc]) -> list[int]:
    """The tokens the chain gives before any abuse (every test that uses the chain asks for this first)."""
    return _tokens(three, [w.addr for w in chain])


def _still_serving(three: Path, chain: list[Proc], before: list[int]) -> None:
    """Every worker process alive, no traceback in its log, and a new coordinator's tokens the same."""
    for w in chain:
        assert w.proc.poll() is None, w.stderr()
        assert "Traceback" not in w.stderr(), w.stderr()
    assert _tokens(three, [w.addr for w in chain]) == before


# --- a hand-driven peer ----------------------------------------------------------------------------


def _hello(m: Manifest, stage: int, role: Role = Role.COORDINATOR, session: str | None = None) -> Hello:
    """The Hello of a peer whose chain ends just before `stage` (as a coordinator or as the
    previous worker of session `session`)."""
    return Hello(PROTOCOL, role, m.model_hash, 0, m.stages[stage].first_layer - 1, m.weights, Activations.F32,
                 secrets.token_hex(16) if session is None else session, run_context(m.arch, None))


class Peer:
    """One connection to a worker, driven by the test: raw bytes or messages out, messages in,
    every wait bounded. `name` is how the worker names this link in its log."""

    def __init__(self, addr: str, hello: Hello | None = None, wait_s: float = WAIT_S) -> None:
        host, _, port = addr.rpartition(":")
        # The OS reuses ephemeral ports, so an earlier test's link may have had this name: the
        # worker's lines about this link are those logged from this moment on.
        self.opened = time.time()
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.settimeout(None)
        self.name = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.link = Link(self.sock, addr, frame_timeout=wait_s, handshake_timeout=wait_s)
        self.session = hello.session if hello is not None else ""
        self.theirs = client_handshake(self.link, hello, lambda _: None) if hello is not None else None
        # Link's wait for the next frame to begin (None: for ever, as between frames in production):
        # a test waits a bounded time, and a TimedOut is a failure of the test, not of the worker.
        self.link._wait = wait_s

    def send(self, msg: Message) -> None:
        self.link.send(msg)

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Message:
        return self.link.recv()

    def until_closed(self) -> list[Message]:
        """What the worker sends before it closes this link (TimedOut if it does not)."""
        got: list[Message] = []
        while True:
            try:
                got.append(self.link.recv())
            except LinkClosed:
                return got

    def quiet(self, seconds: float) -> bool:
        """Nothing arrives for `seconds`, and the link is still open."""
        self.link._wait = seconds
        try:
            msg = self.link.recv()
        except TimedOut:
            return True
        except LinkClosed:
            return False
        finally:
            self.link._wait = WAIT_S
        raise AssertionError(f"unexpected {msg}")

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _coordinator(addr: str, m: Manifest, stage: int, route: str = "", session: str | None = None) -> Peer:
    """A peer that has made a coordinator's handshake with the worker for `stage`, and routed it."""
    p = Peer(addr, _hello(m, stage, session=session))
    p.send(Route(route))
    return p


def _step(key: int, cache: int, t: int = 1, *, first: bool = False, seq: int = 0, width: int = 576,
          keep: tuple[int, ...] = (), merge: tuple[int, ...] = (), hidden: np.ndarray | None = None,
          positions: np.ndarray | None = None, slots: int | None = None, want_logits: bool = False,
          sample_all: bool = False, seed: int = 0) -> Forward:
    """A well-typed Forward of `t` new tokens after `cache` slots (every mask column attended)."""
    b = max(1, len(keep) + len(merge))
    width_s = cache + t if slots is None else slots
    if hidden is None:
        hidden = np.random.default_rng(seed).standard_normal((b, t, width)).astype(np.float32)
    if positions is None:
        positions = np.tile(np.arange(cache, cache + t, dtype=np.int64), (b, 1))
    sample_at = [[r, i] for r in range(b) for i in range(t)] if sample_all else [[r, t - 1] for r in range(b)]
    return Forward(key, seq, Phase.PREFILL if first else Phase.DECODE, first, width_s, want_logits, False,
                   [SamplingParams()] * b, np.arange(1000, 1000 + b, dtype=np.int64),
                   np.asarray(keep, np.int64), np.asarray(merge, np.int64), hidden,
                   mask_to_runs(np.ones((b, width_s), np.int64)), positions, np.array(sample_at, np.int64),
                   None, None, None, None, None, no_hops())


def _dropped(w: Proc, p: Peer) -> str:
    """The worker's log line about dropping `p`'s link ("" when there is none within 5 s)."""
    def mine() -> list[str]:
        return [line for line in w.stderr().splitlines()
                if f"dropping {p.name}: " in line and _logged_at(line) >= p.opened]
    deadline = time.monotonic() + 5
    while not (got := mine()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got[0] if got else ""


def _logged_at(line: str) -> float:
    """When a worker logged `line` (logging's default "YYYY-mm-dd HH:MM:SS,mmm", local time),
    rounded up to the next millisecond so a line logged in the same millisecond counts as later."""
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp() + 0.001


def _fds(w: Proc) -> int:
    return psutil.Process(w.proc.pid).num_fds()


def _fd_targets(w: Proc) -> list[str]:
    """What the worker's descriptors point at (sockets, pipes, files), for a failure's message."""
    folder = Path(f"/proc/{w.proc.pid}/fd")
    targets = []
    for fd in folder.iterdir():
        with contextlib.suppress(OSError):  # closed while we looked
            targets.append(os.readlink(fd))
    return sorted(targets)


def _idle_fds(w: Proc) -> int:
    """The worker's open descriptors once the links an earlier test closed are gone (the same
    count for half a second; the worker closes its side on its own threads)."""
    seen = [_fds(w)]
    deadline = time.monotonic() + 10
    while (len(seen) < 5 or len(set(seen[-5:])) > 1) and time.monotonic() < deadline:
        time.sleep(0.1)
        seen.append(_fds(w))
    return seen[-1]


def _eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `check` holds within `timeout_s` (a worker closes and frees on its own threads)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def _refusal_of(addr: str, hello: Hello) -> str | None:
    """The worker's reason for refusing `hello` (None: it accepted it; the link is closed again)."""
    with Peer(addr) as p:
        try:
            client_handshake(p.link, hello, lambda _: None)
        except Refused as e:
            return str(e)
    return None


# --- 1. fuzzed frames after a valid coordinator handshake -----------------------------------------


def _codec_refused() -> list[bytes]:
    """Valid messages of every kind with one JSON field of the wrong type or missing or an extra
    one, one array of the wrong dtype, ndim or shape, or an out-of-range value: well framed
    (right length and checksum), each refused by the codec."""
    out: list[bytes] = []
    for msg in SAMPLES:
        fields, _ = split(msg)
        out += [rebuild(msg, fields | {name: value}) for name, value in _wrong_fields(msg)]
        out += [rebuild(msg, {k: v for k, v in fields.items() if k != name}) for name in fields]
        out.append(rebuild(msg, fields | {"extra": 1}))
        out += [rebuild(msg, arrays={name: raw}) for name, raw in _wrong_arrays(msg)]
        if isinstance(msg, Forward):
            out += [rebuild(msg, arrays={k: array_bytes(a) for k, a in change.items()})
                    for change in _forward_out_of_range(msg)]
            out += [rebuild(msg, fields | {"slots": s}) for s in (msg.hidden.shape[1] - 1, MAX_SLOTS + 1, -1)]
    return out


REFUSED = _codec_refused()


def _refusal(raw: bytes) -> str | None:
    """The codec's reason for refusing a whole frame (None: it decodes)."""
    try:
        decode_frame(raw)
    except WireError as e:
        return str(e)
    return None


bad_frames = st.one_of(
    st.tuples(st.just("typed"), st.sampled_from(REFUSED)),
    st.tuples(st.just("payload"), st.builds(frame, st.sampled_from(sorted(MESSAGES)), st.binary(max_size=300))),
    st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=300)),
)


def test_the_fuzzed_frames_are_all_refused_by_the_codec() -> None:
    assert len(REFUSED) > 400 and all(_refusal(raw) for raw in REFUSED)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bad_frames, st.integers(0, 1))
def test_a_fuzzed_frame_closes_only_its_link(chain: list[Proc], manifest: Manifest, before: list[int],
                                             case: tuple[str, bytes], i: int) -> None:
    """After a valid handshake (and Route), a frame the codec refuses closes that link without a
    word; the worker logs why, in one line naming the link."""
    what, raw = case
    why = _refusal(raw)
    assume(why is not None)
    w = chain[i]
    with _coordinator(w.addr, manifest, i + 1) as p:
        p.raw(raw)
        if what == "garbage":  # it may end anywhere: the worker then sees the stream end
            p.sock.shutdown(socket.SHUT_WR)
        assert p.until_closed() == []
        line = _dropped(w, p)
        if what == "garbage":  # not a frame of ours, or one cut short by the end of the stream
            assert line, raw
        else:  # a whole frame: the worker refuses it for the codec's reason
            assert line.endswith(f"dropping {p.name}: {why}"), (line, why)


def test_the_fuzzed_workers_still_serve(three: Path, chain: list[Proc], before: list[int]) -> None:
    fds = [_idle_fds(w) for w in chain]
    _still_serving(three, chain, before)
    assert _eventually(lambda: [_fds(w) for w in chain] == fds)  # every link's socket is closed again


# --- 2. well-typed steps that do not fit, and messages that have no business on a link ------------


def test_steps_that_do_not_fit_fail_alone(chain: list[Proc], manifest: Manifest, before: list[int]) -> None:
    """StepFailed for that step only, with the reason; the link and the other keys go on."""
    last = chain[1]  # the last stage: a step that runs comes back as Sampled
    with _coordinator(last.addr, manifest, 2) as p:
        p.send(_step(1, 0, 3, first=True, seq=1))
        assert isinstance(p.recv(), Sampled)  # key 1: 3 slots
        p.send(_step(2, 0, 2, first=True, seq=2))
        assert isinstance(p.recv(), Sampled)  # key 2: 2 slots, one row
        cases: list[tuple[Forward, str]] = [
            (_step(9, 3), "unknown key 9 on stage2"),  # never opened
            (dataclasses.replace(_step(3, 0, 2), phase=Phase.PREFILL), "unknown key 3"),  # first=False, fresh key
            (_step(1, 3, width=100), "hidden states of shape (1, 1, 100)"),
            (_step(1, 3, width=4096), "hidden states of shape (1, 1, 4096)"),
            (_step(-1, 3, merge=(1, 77)), "cannot merge 77 into -1: not an open one-row state"),
            (_step(1, 3, merge=(1,)), "cannot merge 1 into 1: not an open one-row state"),  # the group itself
            (_step(1, 3, keep=(3,)), "rows [3] of a state of 1"),  # a row the state does not have
            (_step(1, 3, keep=(4,), merge=(2,)), "cannot keep rows [4] of 1"),
            (_step(1, 4), "a mask of 5 slots for a cache of 3 plus 1"),  # does not fit the cache
            (_step(1, 1, 2), "a mask of 3 slots for a cache of 3 plus 2"),
            (_step(6, 0, 2, first=True, slots=5), "a mask of 5 slots for a cache of 0 plus 2"),
        ]
        for seq, (msg, why) in enumerate(cases, start=10):
            p.send(dataclasses.replace(msg, seq=seq))
            reply = p.recv()
            assert isinstance(reply, StepFailed) and reply.seq == seq and why in reply.reason, (why, reply)
        # The failed merges changed nothing: key 1 has its 3 slots, key 2 its own.
        p.send(_step(1, 3, seq=40))
        assert isinstance(reply := p.recv(), Sampled) and reply.seq == 40
        p.send(_step(2, 2, seq=41))
        assert isinstance(reply := p.recv(), Sampled) and reply.seq == 41
        # Positions beyond the cache but within the context the worker serves: the graph runs
        # (RoPE of any position); at or past it (within the wire's bound), the step fails.
        context = run_context(manifest.arch, None)
        p.send(_step(1, 4, seq=42, positions=np.array([[context - 1]], np.int64)))
        assert isinstance(reply := p.recv(), Sampled) and reply.seq == 42
        p.send(_step(1, 5, seq=44, positions=np.array([[MAX_SLOTS - 1]], np.int64)))
        assert isinstance(reply := p.recv(), StepFailed) and reply.seq == 44
        assert f"position {MAX_SLOTS - 1} is past the context of {context} tokens" in reply.reason
        p.send(_step(1, 5, seq=45, positions=np.array([[context]], np.int64)))
        assert isinstance(reply := p.recv(), StepFailed) and f"position {context} is past the context" in reply.reason
        # Hidden states that are not numbers: no token can be chosen, and the entry says why (its
        # stream fails alone: the step's other rows, if any, are sampled as usual).
        p.send(_step(4, 0, 2, first=True, seq=43, hidden=np.full((1, 2, 576), np.nan, np.float32)))
        assert isinstance(reply := p.recv(), Sampled) and reply.tokens.tolist() == [-1]
        assert reply.failed is not None
        assert [Unsampleable.REASONS[c] for c in reply.failed] == ["the logits are not finite"]
        p.send(_step(5, 0, 3, first=True, seq=44))  # a following good step on another key
        assert isinstance(reply := p.recv(), Sampled) and reply.seq == 44
        assert p.quiet(0.2)
    assert "Traceback" not in last.stderr()


POSITIONS = f"malformed Forward: positions out of range 0-{MAX_SLOTS - 1}"


@pytest.mark.parametrize("change,why", [
    ({"sample_at": np.array([[0, 1]], np.int64)}, "malformed Forward: sample position out of range 0-0"),
    ({"sample_at": np.array([[1, 0]], np.int64)}, "malformed Forward: sample row out of range 0-0"),
    ({"position_ids": np.array([[MAX_SLOTS]], np.int64)}, POSITIONS),
    ({"position_ids": np.array([[1 << 62]], np.int64)}, POSITIONS),
], ids=["sample-position", "sample-row", "position-max-slots", "position-huge"])
def test_steps_the_codec_refuses_close_their_link(chain: list[Proc], manifest: Manifest, before: list[int],
                                                   change: dict[str, np.ndarray], why: str) -> None:
    last = chain[1]
    with _coordinator(last.addr, manifest, 2) as p, _coordinator(last.addr, manifest, 2) as other:
        p.send(_step(1, 0, 3, first=True))
        assert isinstance(p.recv(), Sampled)
        good = _step(1, 3)
        p.raw(rebuild(good, arrays={k: array_bytes(a) for k, a in change.items()}))
        assert p.until_closed() == []
        assert _dropped(last, p).endswith(why)
        other.send(_step(1, 0, 3, first=True))  # another coordinator, the same key: served
        assert isinstance(other.recv(), Sampled)


NO_BUSINESS = [
    pytest.param(_hello, "Hello", id="second-hello"),
    pytest.param(lambda m, s: SAMPLES[8], "Sampled", id="sampled"),
    pytest.param(lambda m, s: ShardChunk("manifest.json", 0, 1, "0" * 64, np.zeros(1, np.uint8)), "ShardChunk",
                 id="shard-chunk"),
    pytest.param(lambda m, s: ShardRequest("manifest.json"), "ShardRequest", id="shard-request"),
    pytest.param(lambda m, s: StepFailed(1, 2, "no"), "StepFailed", id="step-failed"),
    pytest.param(lambda m, s: Refuse("go away"), None, id="refuse"),  # closed without an answer
]


@pytest.mark.parametrize("make,kind", NO_BUSINESS)
def test_a_message_with_no_business_after_the_handshake_is_refused(
        chain: list[Proc], manifest: Manifest, before: list[int], make: Callable[[Manifest, int], Message],
        kind: str | None) -> None:
    """Refuse, then that link closes; the worker's other sessions go on."""
    last = chain[1]
    with _coordinator(last.addr, manifest, 2) as other:
        other.send(_step(3, 0, 2, first=True))
        assert isinstance(other.recv(), Sampled)
        with _coordinator(last.addr, manifest, 2) as p:
            p.send(make(manifest, 2))
            assert p.until_closed() == ([Refuse(f"a worker does not take {kind} here")] if kind else [])
        other.send(_step(3, 2))
        assert isinstance(other.recv(), Sampled)


def test_release_and_route_on_a_worker_to_worker_link_are_refused(chain: list[Proc], manifest: Manifest,
                                                                  before: list[int]) -> None:
    """A link from the previous worker carries Forwards only: a Release or a Route on it is
    refused and that link closes; the session's coordinator keeps its streams."""
    last = chain[1]
    with _coordinator(last.addr, manifest, 2) as coord:
        coord.send(_step(1, 0, 3, first=True))
        assert isinstance(coord.recv(), Sampled)
        with Peer(last.addr, _hello(manifest, 2, Role.WORKER, coord.session)) as upstream:
            upstream.send(_step(1, 3, seq=5))  # a Forward from upstream: answered to the coordinator
            assert isinstance(reply := coord.recv(), Sampled) and reply.seq == 5
            upstream.send(Release(1))
            assert upstream.until_closed() == [Refuse("a worker does not take Release here")]
        with Peer(last.addr, _hello(manifest, 2, Role.WORKER, coord.session)) as upstream:
            upstream.send(Route(""))
            assert upstream.until_closed() == [Refuse("a Route is taken only from the session's coordinator")]
            assert "a Route is taken only from the session's coordinator" in _dropped(last, upstream)
        coord.send(_step(1, 4, seq=6))  # key 1 was neither released nor disturbed
        assert isinstance(reply := coord.recv(), Sampled) and reply.seq == 6


def _hang_up(server: socket.socket) -> None:
    """Accept one connection, read what it sends first, and close it."""
    conn, _ = server.accept()
    with conn:
        conn.settimeout(10)
        conn.recv(1 << 16)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nobody listens there once this socket is closed


@pytest.mark.parametrize("route,why", [
    ("closed", "Connection refused"),
    ("..:7001", "encoding with 'idna' codec failed"),  # a name no resolver takes
    ("no-port", "the next worker must be HOST:PORT with a port in 0-65535, got 'no-port'"),
    ("127.0.0.1:99999", "must be HOST:PORT with a port in 0-65535"),
    ("itself", "layer order: the worker's chain ends at layer 19, but this worker serves layers 10-19"),
    ("hangs-up", "closed the connection"),
])
def test_a_route_that_leads_nowhere_refuses_its_coordinator_only(
        chain: list[Proc], manifest: Manifest, before: list[int], route: str, why: str) -> None:
    first = chain[0]
    with contextlib.ExitStack() as stack:
        if route == "closed":
            route = f"127.0.0.1:{_closed_port()}"
        elif route == "itself":
            route = first.addr
        elif route == "hangs-up":  # accepts, then closes without a word
            server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            route = f"127.0.0.1:{server.getsockname()[1]}"
            threading.Thread(target=_hang_up, args=(server,), daemon=True).start()
        other = stack.enter_context(_coordinator(first.addr, manifest, 1))  # star: hidden states come back
        with _coordinator(first.addr, manifest, 1, route=route) as p:
            got = p.until_closed()
        assert len(got) == 1 and isinstance(got[0], Refuse), got
        assert got[0].reason.startswith(f"cannot reach the next worker {route}: ") and why in got[0].reason, got
        assert why in _dropped(first, p)
        other.send(_step(1, 0, 2, first=True))
        assert isinstance(reply := other.recv(), Forward) and reply.hidden.shape == (1, 2, 576)
    assert "Traceback" not in first.stderr()


def test_routes_again_and_again_hold_one_next_link(chain: list[Proc], manifest: Manifest, before: list[int]) -> None:
    """A coordinator that sends Route after Route: each replaces the session's next link, and
    the one it replaces is closed (on both workers), not kept open until the session ends."""
    first, last = chain
    fds = [_idle_fds(first), _idle_fds(last)]
    with _coordinator(last.addr, manifest, 2) as tail:
        session = tail.session
        with _coordinator(first.addr, manifest, 1, route=last.addr, session=session) as head:
            for _ in range(20):
                head.send(Route(last.addr))
            head.send(_step(1, 0, 2, first=True, seq=3))
            assert isinstance(reply := tail.recv(), Sampled) and reply.seq == 3  # through the last route
            # The coordinator link and one next link on the first worker; the coordinator link and
            # the link from the first worker on the last one.
            assert _eventually(lambda: [_fds(first), _fds(last)] == [fds[0] + 2, fds[1] + 2]), \
                ([_fds(first), _fds(last)], fds)
    assert _eventually(lambda: [_fds(first), _fds(last)] == fds)


# --- 3. before the handshake: a small bounded buffer, and timeouts --------------------------------


def test_a_header_announcing_a_gigabyte_is_refused_at_once(chain: list[Proc], before: list[int]) -> None:
    """Before the handshake the worker allocates only a small buffer, whatever a header says."""
    w = chain[1]
    proc = psutil.Process(w.proc.pid)
    rss = proc.memory_info().rss
    peers = [Peer(w.addr, wait_s=5) for _ in range(8)]  # at once: each closed within 5 s, not after 1 GB
    try:
        for p in peers:
            p.raw(HEADER.pack(MAGIC, PROTOCOL, Hello.KIND, (1 << 30) - 1, 0) + b"x" * 100)
        for p in peers:
            assert p.until_closed() == []
            assert _dropped(w, p).endswith(f"dropping {p.name}: {p.name} announced a frame of {(1 << 30) - 1} "
                                           "bytes; this link accepts at most 65536 for now")
    finally:
        for p in peers:
            p.close()
    assert proc.memory_info().rss - rss < 64 << 20


def test_after_the_handshake_an_announced_gigabyte_costs_only_what_arrives(
        chain: list[Proc], manifest: Manifest, before: list[int]) -> None:
    """A handshaken peer may announce up to MAX_PAYLOAD, but the worker's buffer grows only
    with the bytes that really come (it used to allocate the whole announced frame at once)."""
    w = chain[1]
    proc = psutil.Process(w.proc.pid)
    rss = proc.memory_info().rss
    peers = [_coordinator(w.addr, manifest, 2) for _ in range(3)]
    try:
        for p in peers:
            p.raw(HEADER.pack(MAGIC, PROTOCOL, Forward.KIND, (1 << 30) - 1, 0) + b"x" * 13)
        time.sleep(0.5)
        assert proc.memory_info().rss - rss < 64 << 20
    finally:
        for p in peers:
            p.close()


def test_a_coordinator_that_floods_steps_before_its_route_is_dropped(chain: list[Proc], manifest: Manifest,
                                                                    before: list[int]) -> None:
    """Steps that arrive before their session's Route are held, at most MAX_QUEUED of them."""
    w = chain[1]
    with Peer(w.addr, _hello(manifest, 2)) as p:
        for key in range(worker_module.MAX_QUEUED + 8):
            try:
                p.send(_step(key, 0, 1, first=True))
            except LinkClosed:  # the worker refused and closed before the last ones were sent
                break
        got = p.until_closed()
        assert [type(m) for m in got] == [Refuse]
        assert got[0].reason == f"more than {worker_module.MAX_QUEUED} steps before a Route"  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def inproc(three: Path) -> Iterator[StageWorker]:
    """An in-process worker for the last stage, with timeouts short enough to wait for."""
    w = StageWorker(three, 2, 2, frame_timeout=0.5, handshake_timeout=0.5)
    w.listen("127.0.0.1", 0)
    threading.Thread(target=w.serve_forever, daemon=True, name="executor").start()
    yield w
    w.stop()


def _addr(w: StageWorker) -> str:
    return f"127.0.0.1:{w.port}"


def _readers() -> int:
    return sum(t.name == "read" for t in threading.enumerate())


def _readers_back_to(n: int) -> bool:
    deadline = time.monotonic() + 5
    while _readers() > n and time.monotonic() < deadline:
        time.sleep(0.02)
    return _readers() <= n


@pytest.mark.parametrize("send", ["nothing", "half a hello", "a trickle", "a big header"])
def test_a_silent_or_slow_peer_is_refused_before_the_handshake(inproc: StageWorker, manifest: Manifest,
                                                               send: str) -> None:
    """Within the handshake timeout (0.5 s here), with a Refuse that says why; its reader ends."""
    readers = _readers()
    hello = encode(_hello(manifest, 2))
    with Peer(_addr(inproc), wait_s=3) as p:  # refused within 3 s, by the 0.5 s deadline the reason names
        if send == "half a hello":
            p.raw(hello[: len(hello) // 2])
        elif send == "a big header":  # 60 KiB announced (allowed), 10 sent
            p.raw(HEADER.pack(MAGIC, PROTOCOL, Hello.KIND, 60 << 10, 0) + b"x" * 10)
        elif send == "a trickle":  # a byte every 0.1 s: the frame's deadline, not each read's, ends it
            def trickle() -> None:
                with contextlib.suppress(OSError):
                    for b in hello:
                        p.sock.send(bytes([b]))
                        time.sleep(0.1)
            threading.Thread(target=trickle, daemon=True).start()
        (refused,) = p.until_closed()
    assert isinstance(refused, Refuse) and refused.reason.startswith(f"handshake with {p.name}: {p.name} ")
    assert ("sent nothing for 0.5 s" if send == "nothing" else "did not complete the frame within 0.5 s") \
        in refused.reason, refused
    assert _readers_back_to(readers)


def test_a_half_sent_frame_after_the_handshake_times_out(inproc: StageWorker, manifest: Manifest,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with Peer(_addr(inproc), _hello(manifest, 2), wait_s=3) as p:  # closed within 3 s, by the 0.5 s deadline
        raw = encode(_step(1, 0, 3, first=True))
        p.raw(raw[:-100])
        assert p.until_closed() == []
    assert _eventually(lambda: p.session not in inproc.sessions)  # and its session ended
    assert f"dropping {p.name}: {p.name} sent {len(raw) - 100 - HEADER.size} of {len(raw) - HEADER.size} bytes " \
           "and did not complete the frame within 0.5 s" in caplog.text


def test_a_peer_that_stops_reading_does_not_stall_the_others(inproc: StageWorker, manifest: Manifest) -> None:
    """A coordinator that sends steps with big replies and never reads them: the worker's one
    executor would block in its send for ever, and every other session with it. The send gives
    up once it makes no progress for the frame timeout (0.5 s here), and only that link goes."""
    with Peer(_addr(inproc), _hello(manifest, 2), wait_s=10) as honest:  # every reply within 10 s
        honest.send(Route(""))
        honest.send(_step(1, 0, 2, first=True, seq=1))
        assert isinstance(honest.recv(), Sampled)
        with Peer(_addr(inproc), _hello(manifest, 2)) as deaf:
            deaf.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            deaf.send(Route(""))
            for key in range(3):  # 64 logits rows of 49152 floats each: 12.6 MB a reply
                deaf.send(_step(key, 0, 64, first=True, want_logits=True, sample_all=True))
            time.sleep(1)  # the executor is at the first of them by now
            honest.send(_step(1, 2, seq=2))
            assert isinstance(reply := honest.recv(), Sampled) and reply.seq == 2
            assert _eventually(lambda: deaf.session not in inproc.sessions)  # its link dropped, its streams freed
        assert honest.session in inproc.sessions
        honest.send(_step(1, 3, seq=3))
        assert isinstance(reply := honest.recv(), Sampled) and reply.seq == 3


class _NoReaderThreads:
    """worker.py's `threading`, except that the next `n` reader threads fail to start (as when
    the process has run out of threads or memory)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)

    def Thread(self, *args: Any, **kwargs: Any) -> threading.Thread:  # threading.Thread's name
        if kwargs.get("name") == "read" and self.n:
            self.n -= 1
            raise RuntimeError("can't start new thread")
        return threading.Thread(*args, **kwargs)


def test_a_reader_that_cannot_start_costs_its_connection_only(inproc: StageWorker, manifest: Manifest,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(worker_module, "threading", _NoReaderThreads(2))
    for _ in range(2):
        with Peer(_addr(inproc), wait_s=5) as p:
            p.raw(encode(_hello(manifest, 2)))
            assert p.until_closed() == []  # closed at once, not left hanging
    assert "can't start new thread" in caplog.text
    with Peer(_addr(inproc), _hello(manifest, 2), wait_s=5) as p:  # the acceptor goes on
        p.send(Route(""))
        p.send(_step(1, 0, 2, first=True))
        assert isinstance(p.recv(), Sampled)


# --- 4. out of file descriptors -------------------------------------------------------------------

NOFILE = 64


def test_the_accept_loop_outlives_running_out_of_file_descriptors(three: Path, chain: list[Proc],
                                                                  before: list[int]) -> None:
    """A worker allowed 64 descriptors: connections until it can accept no more; it logs and
    goes on serving the chain it has; once they close, a new coordinator connects and runs."""
    with worker(three, "1", nofile=NOFILE) as limited:
        addrs = [limited.addr, chain[1].addr]
        assert _tokens(three, addrs) == before  # whatever a first run opens for good is open before the count
        idle = _idle_fds(limited)
        remote = RemotePipeline(three, addrs, RunConfig(), "f32")  # connected before the flood
        junk: list[socket.socket] = []
        try:
            for _ in range(NOFILE + 16):  # past the limit; the rest wait in the listen backlog
                junk.append(socket.create_connection(("127.0.0.1", limited.port), timeout=10))
            log = limited.wait_for_stderr("accept failed", timeout_s=10)
            assert "accept failed ([Errno 24] Too many open files); still accepting" in log, log
            assert _fds(limited) == NOFILE
            assert _tokens_through(remote) == before  # the links it has serve on
        finally:
            for s in junk:
                s.close()
            remote.shutdown()
        # Every junk connection accepted, then closed (the message names what is still open).
        assert _eventually(lambda: _fds(limited) <= idle, 30), (idle, _fd_targets(limited))
        assert _tokens(three, addrs) == before  # a new coordinator, new links
        assert limited.proc.poll() is None and "Traceback" not in limited.stderr()


# --- 5. sessions ----------------------------------------------------------------------------------


def test_a_session_is_its_coordinators_alone(chain: list[Proc], manifest: Manifest, before: list[int]) -> None:
    """A second coordinator claiming a connected session, a worker-role link naming an unknown
    one, a bad session id: refused at the handshake. Two coordinators using the same key: each
    its own stream; one's Release or unknown steps do nothing to the other's."""
    last = chain[1]
    with _coordinator(last.addr, manifest, 2) as a, _coordinator(last.addr, manifest, 2) as b:
        refusals = {
            f"session {a.session[:8]} is already connected": _hello(manifest, 2, session=a.session),
            f"no coordinator of session {'ab' * 4} is connected here":
                _hello(manifest, 2, Role.WORKER, session="ab" * 16),
            "a session id of 32 hex digits is required": _hello(manifest, 2, session="abc"),
        }
        for why, hello in refusals.items():
            with pytest.raises(Refused, match=why), Peer(last.addr) as p:
                client_handshake(p.link, hello, lambda _: None)
        a.send(_step(5, 0, 3, first=True, seq=1, seed=1))
        assert isinstance(a.recv(), Sampled)
        b.send(_step(5, 3, seq=2))  # a's key 5 is not b's
        assert isinstance(reply := b.recv(), StepFailed) and "unknown key 5" in reply.reason
        b.send(Release(5))  # frees b's key 5 (none): a's stays
        b.send(_step(5, 0, 6, first=True, seq=3, seed=2))  # b's own key 5, a longer cache
        assert isinstance(reply := b.recv(), Sampled) and reply.seq == 3
        a.send(_step(5, 3, seq=4))  # a's key 5 still has its 3 slots
        assert isinstance(reply := a.recv(), Sampled) and reply.seq == 4
        b.send(_step(5, 6, seq=5))
        assert isinstance(reply := b.recv(), Sampled) and reply.seq == 5
        b.close()  # b's session ends with its link: a worker link naming it is refused from then on
        assert _eventually(lambda: _refusal_of(last.addr, _hello(manifest, 2, Role.WORKER, session=b.session))
                           == f"no coordinator of session {b.session[:8]} is connected here")
        a.send(_step(5, 4, seq=6))
        assert isinstance(reply := a.recv(), Sampled) and reply.seq == 6


def test_the_abused_workers_still_serve(three: Path, chain: list[Proc], before: list[int]) -> None:
    _still_serving(three, chain, before)
