"""Wire messages: every message round-trips; truncated, corrupt and malformed frames are refused."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from shardline.wire.codec import HEADER, MAGIC, WireError, decode, encode
from shardline.wire.messages import (
    MESSAGES,
    PROTOCOL,
    CloseStream,
    Forward,
    Hello,
    Message,
    OpenStream,
    Refuse,
    Route,
    Sampled,
    ShardChunk,
    ShardRequest,
)

rng = np.random.default_rng(0)
HOPS = np.array([[0, 0.0071, 0.0, 0.0002, 0.00002], [1, 0.0069, 0.00005, 0.0001, 0.00003]])
SAMPLES: list[Message] = [
    Hello(PROTOCOL, "worker", "ab" * 32, 15, 29, "gguf", "f16"),
    Refuse("model hash mismatch: worker has x, coordinator has y"),
    OpenStream(7),
    CloseStream(7),
    Forward(7, 3, "prefill", [7], [0], [], rng.standard_normal((1, 5, 576)).astype(np.float16),
            np.ones((1, 9), np.int64), np.arange(4, 9, dtype=np.int64)[None], [{"temperature": 0.0, "seed": 1}],
            False, HOPS[:1]),
    Forward(7, 4, "decode", [7], [0], [], rng.standard_normal((1, 1, 576)).astype(np.float32),
            np.array([[1, 1, 0, 1]], np.int64), np.array([[3]], np.int64), [{}], True, np.zeros((0, 5))),
    Forward(-1, 5, "decode", [3, 9, 4], [1, 0], [4], rng.standard_normal((3, 1, 576)).astype(np.float16),
            np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1]], np.int64), np.array([[5], [2], [1]], np.int64),
            [{}, {"temperature": 0.5}, {}], False, HOPS[:1]),
    Sampled(7, 4, [7], [42], [-0.25], None, HOPS),
    Sampled(7, 4, [7], [42], [-0.25], rng.standard_normal((1, 49152)).astype(np.float32), HOPS),
    Sampled(-1, 5, [3, 9], [42, 7], [-0.25, -1.5], None, HOPS),
    ShardRequest("stage1.bin"),
    Route("127.0.0.1:7001"),
    ShardChunk("stage1.bin", 1024, 4096, "cd" * 32, np.arange(256, dtype=np.uint8)),
]


def _equal(a: Message, b: Message) -> bool:
    if type(a) is not type(b):
        return False
    for k, v in vars(a).items():
        w = vars(b)[k]
        if isinstance(v, np.ndarray):
            if not (isinstance(w, np.ndarray) and v.dtype == w.dtype and v.shape == w.shape
                    and np.array_equal(v, w)):
                return False
        elif v != w:
            return False
    return True


def test_every_message_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    assert _equal(decode(encode(msg)), msg)


@pytest.mark.parametrize("msg", SAMPLES[3:6], ids=lambda m: type(m).__name__)
def test_every_truncation_is_refused(msg: Message) -> None:
    frame = encode(msg)
    for cut in sorted({0, 1, 5, HEADER.size - 1, HEADER.size, HEADER.size + 3, len(frame) // 2, len(frame) - 1}):
        with pytest.raises(WireError, match="truncated"):
            decode(frame[:cut])


def test_flipped_bits_are_refused() -> None:
    frame = bytearray(encode(SAMPLES[4]))
    for pos in range(HEADER.size, len(frame), 97):
        bad = bytearray(frame)
        bad[pos] ^= 0x10
        with pytest.raises(WireError, match="checksum mismatch"):
            decode(bytes(bad))


def _frame(kind: int, payload: bytes, magic: bytes = MAGIC, version: int = PROTOCOL) -> bytes:
    return HEADER.pack(magic, version, kind, len(payload), zlib.crc32(payload)) + payload


def _meta(d: dict) -> bytes:
    raw = json.dumps(d).encode()
    return struct.pack("<I", len(raw)) + raw


@pytest.mark.parametrize("frame,message", [
    (_frame(3, _meta({"stream": 1}), magic=b"HT"), "bad magic"),
    (_frame(3, _meta({"stream": 1}), version=99), "protocol version 99"),
    (_frame(200, _meta({"stream": 1})), "unknown message kind 200"),
    (_frame(3, _meta({"stream": 1, "extra": 2})), "malformed OpenStream: fields"),
    (_frame(3, _meta({})), "malformed OpenStream: fields"),
    (_frame(3, _meta({"stream": 1}) + b"junk"), "trailing bytes"),
    (_frame(2, struct.pack("<I", 50) + b"{}"), "malformed Refuse"),
    (_frame(2, struct.pack("<I", 4) + b"\xff\xfe{}"), "malformed Refuse"),
    (_frame(8, _meta({"name": "a", "offset": 0, "total": 1, "sha256": "x"}) + struct.pack("<BBBI", 1, 5, 1, 100)),
     "runs past the end"),
    (_frame(8, _meta({"name": "a", "offset": 0, "total": 1, "sha256": "x"}) + struct.pack("<BBB", 1, 77, 0)),
     "bad array header"),
])
def test_malformed_frames_are_refused(frame: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(frame)


def test_a_frame_of_the_previous_protocol_is_refused() -> None:
    frame = bytearray(encode(SAMPLES[7]))
    frame[2] = 2  # version 2: Forward and Sampled had no rows
    with pytest.raises(WireError, match=f"protocol version 2, expected {PROTOCOL}"):
        decode(bytes(frame))


@pytest.mark.parametrize("msg", SAMPLES[4:10:2] + [SAMPLES[7]], ids=lambda m: type(m).__name__)
def test_stamp_writes_the_encode_time_into_the_senders_own_slot(msg: Message) -> None:
    got = decode(encode(msg, stamp=True))
    assert isinstance(got, Forward | Sampled) and isinstance(msg, Forward | Sampled)
    stamped = got.hops[-1, -1]
    assert 0 < stamped < 0.05 and stamped != msg.hops[-1, -1]
    assert np.array_equal(got.hops.ravel()[:-1], msg.hops.ravel()[:-1])  # every other duration as sent
    assert _equal(got, msg) is False and _equal(decode(encode(msg)), msg)


@pytest.mark.parametrize("msg", [SAMPLES[5], OpenStream(1),
                                 Sampled(1, 1, [1], [1], [0.0], None, np.ones((1, 5), np.float32))],
                         ids=["no rows", "no hops", "f32 hops"])
def test_stamp_needs_an_f64_row(msg: Message) -> None:
    with pytest.raises(WireError, match="has no f64 hops row to stamp its encode time into"):
        encode(msg, stamp=True)


def test_unsupported_dtype_cannot_be_sent() -> None:
    with pytest.raises(WireError, match="cannot travel"):
        encode(ShardChunk("a", 0, 1, "x", np.zeros(3, dtype=np.complex64)))
