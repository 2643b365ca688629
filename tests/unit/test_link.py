"""Links over real sockets: framing across partial reads, handshakes, refusals, garbage; what a
peer can make a link allocate or wait for (payload limit, frame and handshake timeouts)."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.wire.codec import HEADER, MAGIC, MAX_PAYLOAD, WireError, encode
from shardline.wire.link import (
    HANDSHAKE_PAYLOAD,
    Link,
    LinkClosed,
    Refused,
    TimedOut,
    chunk_payload,
    client_handshake,
    server_handshake,
)
from shardline.wire.messages import (
    PROTOCOL,
    Activations,
    Forward,
    Hello,
    Message,
    Phase,
    Refuse,
    Release,
    Role,
    ShardChunk,
    ShardRequest,
    mask_to_runs,
)


def _pair(**options: float) -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(a, "a", **options), Link(b, "b", **options)


def _hello(first: int, last: int, model: str = "m" * 64, role: Role = Role.WORKER) -> Hello:
    return Hello(PROTOCOL, role, model, first, last, "gguf", Activations.F16, "", 8192)


def _prefill(t: int) -> Forward:
    return Forward(1, 0, Phase.PREFILL, True, t, False, False, [SamplingParams()], np.array([1]), np.zeros(0, np.int64),
                   np.zeros(0, np.int64), np.ones((1, t, 576), np.float16), mask_to_runs(np.ones((1, t))),
                   np.arange(t, dtype=np.int64)[None], np.zeros((0, 2), np.int64), None, None, None, None, None,
                   np.zeros((1, 5)))


def _in_thread(f: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            f()
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def _send_all(link: Link, messages: list[Message], pause: float = 0.0) -> None:
    for m in messages:
        time.sleep(pause)
        link.send(m)


def _drip(sock: socket.socket, raw: bytes, size: int, pause: float) -> None:
    for i in range(0, len(raw), size):
        sock.sendall(raw[i : i + size])
        time.sleep(pause)


def test_messages_cross_a_socket_in_order() -> None:
    a, b = _pair()
    b.max_payload = MAX_PAYLOAD  # as after a handshake
    big = _prefill(300)
    sender, _ = _in_thread(lambda: _send_all(a, [Release(1), big, Release(2)]))
    got = [b.recv() for _ in range(3)]
    sender.join()
    assert [type(m).__name__ for m in got] == ["Release", "Forward", "Release"]
    assert isinstance(got[1], Forward) and got[1].hidden.shape == (1, 300, 576)
    assert b.bytes_received == a.bytes_sent
    assert 0 < b.last_decode_s < 0.05  # the last message's decode only


def test_peer_close_and_truncated_frame() -> None:
    a, b = _pair()
    a.close()
    with pytest.raises(LinkClosed):
        b.recv()
    c, d = socket.socketpair()
    c.sendall(encode(Release(5))[:-2])
    c.close()
    with pytest.raises(WireError, match="truncated frame"):
        Link(d).recv()


def test_garbage_is_a_wire_error() -> None:
    c, d = socket.socketpair()
    c.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(WireError, match="bad magic"):
        Link(d).recv()


# --- what a peer can make a link allocate -------------------------------------------------------


def test_before_the_handshake_only_small_frames_are_accepted() -> None:
    a, b = _pair()
    sender, _ = _in_thread(lambda: a.send(_prefill(300)))  # ~350 KB: fine after a handshake, not before
    with pytest.raises(WireError, match=f"b announced a frame of \\d+ bytes; this link accepts at most "
                                        f"{HANDSHAKE_PAYLOAD} for now"):
        b.recv()
    assert len(b._buf) <= 1 << 16  # nothing allocated for it
    b.close()  # the sender, stuck on a full socket, fails
    sender.join(5)


def test_a_header_announcing_a_huge_frame_allocates_nothing() -> None:
    c, d = socket.socketpair()
    c.sendall(HEADER.pack(MAGIC, PROTOCOL, 8, MAX_PAYLOAD, 0))
    link = Link(d, "d")
    with pytest.raises(WireError, match=f"announced a frame of {MAX_PAYLOAD} bytes"):
        link.recv()
    assert len(link._buf) <= 1 << 16


def test_after_the_handshake_a_huge_frame_costs_memory_only_as_its_bytes_arrive() -> None:
    """A peer past the handshake may announce up to MAX_PAYLOAD; the buffer grows (at most
    doubling) with what really arrives, not with what was announced."""
    c, d = socket.socketpair()
    link = Link(d, "d")
    link.max_payload = MAX_PAYLOAD

    def send() -> None:
        c.sendall(HEADER.pack(MAGIC, PROTOCOL, 8, MAX_PAYLOAD, 0) + b"x" * 300_000)
        c.close()

    sender, _ = _in_thread(send)
    with pytest.raises(WireError, match="truncated frame"):
        link.recv()
    sender.join(timeout=10)
    assert len(link._buf) <= 1 << 20


def test_a_limit_that_fits_a_shard_chunk() -> None:
    a, b = _pair()
    chunk = ShardChunk("stage1.bin", 0, 1 << 20, "cd" * 32, np.zeros(1 << 17, np.uint8))
    t, errors = _in_thread(lambda: a.send(chunk))
    b.max_payload = chunk_payload(1 << 17)
    got = b.recv()
    t.join()
    assert isinstance(got, ShardChunk) and got.data.size == 1 << 17 and not errors
    b.max_payload = chunk_payload(1 << 16)
    _in_thread(lambda: a.send(chunk))
    with pytest.raises(WireError, match="announced a frame"):
        b.recv()


def test_a_handshake_lifts_the_limit() -> None:
    a, b = _pair()
    t, errors = _in_thread(lambda: server_handshake(b, _hello(15, 29), lambda h: None))
    client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), lambda h: None)
    t.join()
    assert not errors and a.max_payload == b.max_payload == MAX_PAYLOAD


# --- what a peer can make a link wait for --------------------------------------------------------


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size, HEADER.size + 40])
def test_a_half_sent_frame_times_out(cut: int) -> None:
    c, d = socket.socketpair()
    c.sendall(encode(_prefill(3))[:cut])  # and then nothing, the connection open
    link = Link(d, "slow peer", frame_timeout=0.2)
    start = time.monotonic()
    with pytest.raises(TimedOut, match="slow peer sent .* and did not complete the frame within 0.2 s"):
        link.recv()
    assert 0.15 < time.monotonic() - start < 2


def test_a_trickling_frame_times_out_too() -> None:
    c, d = socket.socketpair()
    _in_thread(lambda: _drip(c, encode(_prefill(3)), 1, 0.02))
    start = time.monotonic()
    with pytest.raises(TimedOut, match="within 0.3 s"):
        Link(d, "drip", frame_timeout=0.3).recv()
    assert time.monotonic() - start < 2


def test_an_idle_link_waits_for_ever_between_frames() -> None:
    a, b = _pair(frame_timeout=0.1, handshake_timeout=0.1)
    _in_thread(lambda: _send_all(a, [Release(1), Release(2)], pause=0.4))
    assert [b.recv(), b.recv()] == [Release(1), Release(2)]


@pytest.mark.parametrize("timeout", [5, float("inf"), 1e30])
def test_a_frame_in_several_pieces_within_the_timeout_arrives(timeout: float) -> None:
    c, d = socket.socketpair()
    raw = encode(_prefill(3))
    _in_thread(lambda: _drip(c, raw, 700, 0.01))
    got = Link(d, frame_timeout=timeout).recv()
    assert isinstance(got, Forward) and got.hidden.shape == (1, 3, 576)


def test_a_send_is_not_cut_short_by_the_receive_timeout() -> None:
    """The reader waits mid-frame with a short timeout while another thread sends a big frame to
    a peer that reads it only later: the send must not time out (settimeout would make it)."""
    a, b = _pair(frame_timeout=0.3)
    b.max_payload = a.max_payload = MAX_PAYLOAD
    b.transport.sendall(encode(Release(1))[:5])  # half a frame towards a: a's reader waits
    reader, read_errors = _in_thread(a.recv)
    time.sleep(0.05)
    big = ShardChunk("x", 0, 8 << 20, "s", np.zeros(8 << 20, np.uint8))  # far more than the socket buffers
    sender, send_errors = _in_thread(lambda: a.send(big))
    time.sleep(0.6)  # the peer is busy; a's frame timeout passes meanwhile
    got = b.recv()
    sender.join(5)
    reader.join(5)
    assert isinstance(got, ShardChunk) and got.data.size == 8 << 20 and not send_errors
    assert len(read_errors) == 1 and isinstance(read_errors[0], TimedOut)


def test_a_silent_client_is_refused_by_the_server() -> None:
    a, b = _pair(handshake_timeout=0.2)
    start = time.monotonic()
    with pytest.raises(Refused, match="handshake with b: b sent nothing for 0.2 s"):
        server_handshake(b, _hello(15, 29), lambda h: None)
    assert time.monotonic() - start < 2
    got = a.recv()  # told why
    assert isinstance(got, Refuse) and "sent nothing" in got.reason


def test_a_silent_server_is_refused_by_the_client() -> None:
    a, b = _pair(handshake_timeout=0.2)
    with pytest.raises(Refused, match="handshake with a: a sent nothing for 0.2 s"):
        client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), lambda h: None)
    assert isinstance(b.recv(), Hello) and isinstance(b.recv(), Refuse)


def test_a_server_that_stops_answering_requests_is_refused() -> None:
    """During delivery the worker (server) waits for each answer within the handshake timeout."""
    a, b = _pair(handshake_timeout=0.2)

    def worker(peer: Hello) -> Hello:
        b.send(ShardRequest("stage1.bin"))
        b.recv()  # the coordinator never answers
        return _hello(15, 29)

    t, errors = _in_thread(lambda: server_handshake(b, worker, lambda h: None))
    a.send(_hello(0, 14, role=Role.COORDINATOR))
    assert isinstance(a.recv(), ShardRequest)
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], Refused) and "sent nothing for 0.2 s" in str(errors[0])


# --- handshakes ---------------------------------------------------------------------------------


def _continues(first: int) -> Callable[[Hello], str | None]:
    def check(h: Hello) -> str | None:
        if h.first_layer != first:
            return f"worker serves layers {h.first_layer}-{h.last_layer}, coordinator expects layers from {first}"
        return None
    return check


def test_handshake_accepts_a_continuing_range() -> None:
    a, b = _pair()
    out: dict[str, Hello] = {}
    t = threading.Thread(target=lambda: out.update(s=server_handshake(b, _hello(15, 29), lambda h: None)))
    t.start()
    peer = client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), _continues(15))
    t.join()
    assert (peer.first_layer, out["s"].role) == (15, Role.COORDINATOR)


def test_handshake_refusal_reaches_both_sides() -> None:
    a, b = _pair()
    errors: list[str] = []

    def serve() -> None:
        server_handshake(b, _hello(10, 29), lambda h: None)
        verdict = b.recv()  # a worker's first message after the handshake: the client may refuse it
        if isinstance(verdict, Refuse):
            errors.append(verdict.reason)

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(Refused, match="worker serves layers 10-29, coordinator expects layers from 15"):
        client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), _continues(15))
    t.join()
    assert errors == ["worker serves layers 10-29, coordinator expects layers from 15"]


def test_server_refuses_a_different_model() -> None:
    a, b = _pair()

    def check(h: Hello) -> str | None:
        if h.model_hash == "m" * 64:
            return None
        return f"model hash mismatch: worker has {'m' * 8}, peer has {h.model_hash[:8]}"

    t = threading.Thread(target=lambda: pytest.raises(Refused, server_handshake, b, _hello(15, 29), check))
    t.start()
    with pytest.raises(Refused, match="model hash mismatch: worker has mmmmmmmm, peer has xxxxxxxx"):
        client_handshake(a, _hello(0, 14, model="x" * 64, role=Role.COORDINATOR), lambda h: None)
    t.join()


def test_requests_before_the_hello_are_served_then_the_hello_checked() -> None:
    a, b = _pair()
    served: list[str] = []

    def serve(msg: Message) -> None:
        assert isinstance(msg, ShardRequest)
        served.append(msg.name)
        a.send(Refuse(f"answer to {msg.name}"))  # any answer: the link does not interpret it

    def worker(peer: Hello) -> Hello:
        for name in ("manifest.json", "stage1.bin"):
            b.send(ShardRequest(name))
            assert isinstance(answer := b.recv(), Refuse) and answer.reason == f"answer to {name}"
        return _hello(15, 29)

    t = threading.Thread(target=lambda: server_handshake(b, worker, lambda h: None))
    t.start()
    peer = client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), _continues(15), serve)
    t.join()
    assert (peer.first_layer, served) == (15, ["manifest.json", "stage1.bin"])


def test_without_a_server_for_requests_a_request_is_not_a_hello() -> None:
    a, b = _pair()
    def server() -> None:
        b.recv()
        b.send(ShardRequest("manifest.json"))
        b.recv()

    t, _ = _in_thread(server)
    with pytest.raises(Refused, match="expected Hello from a, got ShardRequest"):
        client_handshake(a, _hello(0, 14, role=Role.COORDINATOR), lambda h: None)
    t.join()


def test_a_frame_with_a_bad_checksum_over_a_link_is_a_wire_error() -> None:
    c, d = socket.socketpair()
    payload = encode(Release(1))[HEADER.size:]
    c.sendall(HEADER.pack(MAGIC, PROTOCOL, 4, len(payload), zlib.crc32(payload) ^ 1) + payload)
    with pytest.raises(WireError, match="checksum mismatch"):
        Link(d).recv()
