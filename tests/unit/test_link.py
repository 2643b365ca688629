"""Links over real sockets: framing across partial reads, handshakes, refusals, garbage."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from shardline.wire.codec import WireError, encode
from shardline.wire.link import Link, LinkClosed, Refused, client_handshake, server_handshake
from shardline.wire.messages import PROTOCOL, Forward, Hello, Message, OpenStream, Refuse, ShardRequest


def _pair() -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(a, "a"), Link(b, "b")


def _hello(first: int, last: int, model: str = "m" * 64, role: str = "worker") -> Hello:
    return Hello(PROTOCOL, role, model, first, last, "gguf", "f16")


def test_messages_cross_a_socket_in_order() -> None:
    a, b = _pair()
    big = Forward(1, 0, "prefill", [1], [0], [], np.ones((1, 300, 576), np.float16), np.ones((1, 300), np.int64),
                  np.arange(300, dtype=np.int64)[None], [{}], False, np.zeros((1, 5)))
    sender = threading.Thread(target=lambda: [a.send(m) for m in (OpenStream(1), big, OpenStream(2))])
    sender.start()
    got = [b.recv() for _ in range(3)]
    sender.join()
    assert [type(m).__name__ for m in got] == ["OpenStream", "Forward", "OpenStream"]
    assert isinstance(got[1], Forward) and got[1].hidden.shape == (1, 300, 576)
    assert b.bytes_received == a.bytes_sent
    assert 0 < b.last_decode_s < 0.05  # the last message's decode only


def test_peer_close_and_truncated_frame() -> None:
    a, b = _pair()
    a.close()
    with pytest.raises(LinkClosed):
        b.recv()
    c, d = socket.socketpair()
    c.sendall(encode(OpenStream(5))[:-2])
    c.close()
    with pytest.raises(WireError, match="truncated frame"):
        Link(d).recv()


def test_garbage_is_a_wire_error() -> None:
    c, d = socket.socketpair()
    c.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(WireError, match="bad magic"):
        Link(d).recv()


def _continues(first: int):  # type: ignore[no-untyped-def]
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
    peer = client_handshake(a, _hello(0, 14, role="coordinator"), _continues(15))
    t.join()
    assert (peer.first_layer, out["s"].role) == (15, "coordinator")


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
        client_handshake(a, _hello(0, 14, role="coordinator"), _continues(15))
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
        client_handshake(a, _hello(0, 14, model="x" * 64, role="coordinator"), lambda h: None)
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
    peer = client_handshake(a, _hello(0, 14, role="coordinator"), _continues(15), serve)
    t.join()
    assert (peer.first_layer, served) == (15, ["manifest.json", "stage1.bin"])


def test_without_a_server_for_requests_a_request_is_not_a_hello() -> None:
    a, b = _pair()
    t = threading.Thread(target=lambda: (b.recv(), b.send(ShardRequest("manifest.json")), b.recv()))
    t.start()
    with pytest.raises(Refused, match="expected Hello from a, got ShardRequest"):
        client_handshake(a, _hello(0, 14, role="coordinator"), lambda h: None)
    t.join()
