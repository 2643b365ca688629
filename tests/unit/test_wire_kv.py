"""The KV messages (KvPull, KvPush, KvPart, KvDone; since protocol 6, KvPull's start slot since
7, KvCopy since 10): they round-trip, and a frame whose fields do not fit (a wrong dtype or shape, a negative
seq, layers out of range, a field of the wrong type) or whose bytes are corrupt is refused by
the codec before any of it reaches a worker or a coordinator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shardline.wire.codec import HEADER, WireError, decode, encode
from shardline.wire.messages import (
    MAX_BLOCKS,
    MAX_KV_PARTS,
    MAX_ROWS,
    MAX_SLOTS,
    PROTOCOL,
    KvCopy,
    KvDone,
    KvPart,
    KvPull,
    KvPush,
    Message,
)
from tests.unit.test_wire import array_bytes, equal, rebuild, split

rng = np.random.default_rng(6)
K = rng.standard_normal((1, 3, 9, 64)).astype(np.float32)
PULL = KvPull(11, 7)
PUSH = KvPush(12, 7, 1, 9, 4)
PART = KvPart(12, 15, 29, "past.15.key", K)
DONE = KvDone(11, 4, "")
COPY = KvCopy(13, 7, 8, 0, np.arange(12, dtype=np.int64))
KV: list[Message] = [PULL, PUSH, PART, DONE, COPY]


def test_kv_pulls_from_a_start_slot_since_protocol_7() -> None:
    assert PROTOCOL >= 7
    assert KvPull(1, 2).start == 0 and KvPull(1, 2, 128).start == 128


@pytest.mark.parametrize("msg", [
    *KV,
    KvPull(0, -3),  # a decode group's key is negative: its state may move too
    KvPull(4, 7, 256),  # a chunk-level transfer's slice: the slots from 256 on
    KvPull(4, 7, MAX_SLOTS),
    KvPush(0, -1, 1, MAX_SLOTS, MAX_KV_PARTS),
    KvPart(3, 0, 0, "v", np.zeros((2, 1, 0, 8), np.float16)),  # an empty cache: 0 slots
    KvPart(3, 0, (1 << 16) - 1, "n" * 256, np.zeros((MAX_ROWS, 1, 1, 1), np.float32)),
    KvDone(9, 0, "unknown key 4 on stage1"),
    KvCopy(0, -2, 5, MAX_ROWS - 1, np.array([1, 3, MAX_SLOTS - 1], np.int64)),  # a group's row into a new key
    KvPull(5, 7, 0, np.array([4, 0, 9], np.int32), 70),  # a paged stream's blocks (protocol 14)
    KvPush(6, 7, 1, 70, 22, np.array([MAX_BLOCKS - 1, 3, 2], np.int32)),
], ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    assert equal(decode(encode(msg)), msg)


@pytest.mark.parametrize("meta,index,message", [
    ({"row": -1}, None, "row -1"),
    ({"row": MAX_ROWS}, None, f"row {MAX_ROWS}"),
    ({"row": True}, None, "row: True is not an integer"),
    ({"dst": 7}, None, "a copy of a key into itself"),
    ({"src": "7"}, None, "src: '7' is not an integer"),
    ({"seq": -1}, None, "negative seq"),
    ({}, np.array([], np.int64), "0 slots"),
    ({}, np.array([0, -1], np.int64), "slots out of range"),
    ({}, np.array([MAX_SLOTS], np.int64), "slots out of range"),
    ({}, np.arange(4, dtype=np.int32), "index is i4"),
    ({}, np.arange(4, dtype=np.float64), "index is f8"),
    ({}, np.zeros((2, 2), np.int64), "index is i8 with 2 dims"),
    ({}, None, None),
])
def test_a_copy_that_does_not_fit_is_refused(meta: dict[str, Any], index: np.ndarray | None,
                                             message: str | None) -> None:
    fields = split(COPY)[0] | meta
    arrays = {} if index is None else {"index": array_bytes(index)}
    if message is None:  # the sample itself, rebuilt: it decodes
        assert equal(decode(rebuild(COPY, fields, arrays=arrays)), COPY)
        return
    with pytest.raises(WireError, match=f"malformed KvCopy: .*{message}"):
        decode(rebuild(COPY, fields, arrays=arrays))


def test_a_part_keeps_its_bits_and_big_endian_travels_little_endian() -> None:
    got = decode(encode(KvPart(1, 2, 3, "k", K.astype(">f4"))))
    assert isinstance(got, KvPart) and got.state.dtype == np.dtype("<f4")
    assert got.state.tobytes() == K.tobytes() and got.state.shape == K.shape


@pytest.mark.parametrize("msg,meta,message", [
    (PULL, {"seq": -1, "key": 7, "start": 0, "tokens": 0}, "negative seq -1"),
    (PULL, {"seq": 1, "key": True, "start": 0, "tokens": 0}, "key: True is not an integer"),
    (PULL, {"seq": "1", "key": 7, "start": 0, "tokens": 0}, "seq: '1' is not an integer"),
    (PULL, {"seq": 1, "key": 1 << 63, "start": 0, "tokens": 0}, "outside the 64-bit range"),
    (PULL, {"seq": 1, "key": 7, "start": -1, "tokens": 0}, "a start slot of -1"),
    (PULL, {"seq": 1, "key": 7, "start": MAX_SLOTS + 1, "tokens": 0}, "a start slot of"),
    (PULL, {"seq": 1, "key": 7, "start": "3", "tokens": 0}, "start: '3' is not an integer"),
    (PULL, {"seq": 1, "key": 7, "start": False, "tokens": 0}, "start: False is not an integer"),
    (PULL, {"seq": 1, "key": 7}, "fields"),  # protocol 6's pull: no start
    (PULL, {"seq": 1, "key": 7, "start": 0}, "fields"),  # protocol 13's pull: no tokens
    (PULL, {"seq": 1, "key": 7, "start": 0, "tokens": 3}, "KvPull.tokens without blocks"),
    (PULL, {"seq": 1}, "fields"),
    (PUSH, split(PUSH)[0] | {"rows": 0}, "0 rows of 9 slots"),
    (PUSH, split(PUSH)[0] | {"rows": MAX_ROWS + 1}, "rows of 9 slots"),
    (PUSH, split(PUSH)[0] | {"slots": -1}, "1 rows of -1 slots"),
    (PUSH, split(PUSH)[0] | {"slots": MAX_SLOTS + 1}, "slots"),
    (PUSH, split(PUSH)[0] | {"parts": 0}, "0 parts"),
    (PUSH, split(PUSH)[0] | {"parts": MAX_KV_PARTS + 1}, "parts"),
    (PUSH, split(PUSH)[0] | {"seq": -5}, "negative seq"),
    (PUSH, split(PUSH)[0] | {"key": 1.0}, "key: 1.0 is not an integer"),
    (PART, split(PART)[0] | {"first_layer": 30}, "bad layer range"),
    (PART, split(PART)[0] | {"first_layer": -1}, "bad layer range"),
    (PART, split(PART)[0] | {"last_layer": 1 << 16}, "bad layer range"),
    (PART, split(PART)[0] | {"name": ""}, "a state name of 1-256 characters"),
    (PART, split(PART)[0] | {"name": "x" * 257}, "a state name of 1-256 characters"),
    (PART, split(PART)[0] | {"name": 5}, "name: 5 is not a string"),
    (PART, split(PART)[0] | {"name": "\ud800"}, "not valid Unicode"),
    (PART, split(PART)[0] | {"seq": None}, "seq: None is not an integer"),
    (DONE, {"seq": 1, "parts": -1, "error": ""}, "-1 parts"),
    (DONE, {"seq": 1, "parts": MAX_KV_PARTS + 1, "error": ""}, "parts"),
    (DONE, {"seq": 1, "parts": 2, "error": None}, "error: None is not a string"),
    (DONE, {"seq": 1, "parts": False, "error": ""}, "parts: False is not an integer"),
    (DONE, {"seq": 1, "parts": 2, "error": "", "more": 1}, "fields"),
])
def test_fields_that_do_not_fit_are_refused(msg: Message, meta: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=f"malformed {type(msg).__name__}: .*{message}"):
        decode(rebuild(msg, meta))


@pytest.mark.parametrize("state,message", [
    (np.zeros((1, 3, 9, 64), np.float64), "state is f8 with 4 dims, not f4/f2 with 4"),
    (np.zeros((1, 3, 9, 64), np.int64), "state is i8"),
    (np.zeros((1, 3, 9, 64), np.uint8), "state is u1"),
    (np.zeros((3, 9, 64), np.float32), "state is f4 with 3 dims"),
    (np.zeros((1, 1, 3, 9, 64), np.float32), "state is f4 with 5 dims"),
    (np.zeros((0, 3, 9, 64), np.float32), r"a KV state of shape \[0, 3, 9, 64\]"),
    (np.zeros((MAX_ROWS + 1, 1, 1, 1), np.float32), "a KV state of shape"),
    (np.zeros((1, 0, 9, 64), np.float32), "a KV state of shape"),
    (np.zeros((1, 3, 9, 0), np.float32), "a KV state of shape"),
    (None, "state is missing"),
])
def test_parts_of_the_wrong_dtype_or_shape_are_refused(state: np.ndarray | None, message: str) -> None:
    with pytest.raises(WireError, match=f"malformed KvPart: .*{message}"):
        decode(rebuild(PART, arrays={"state": array_bytes(state)}))


def test_a_part_whose_bytes_run_short_is_refused() -> None:
    raw = array_bytes(K)[:-4]
    with pytest.raises(WireError, match="malformed KvPart: state of shape .* runs past the end"):
        decode(rebuild(PART, arrays={"state": raw}))


@pytest.mark.parametrize("msg", KV, ids=lambda m: type(m).__name__)
def test_corrupt_and_truncated_frames_are_refused(msg: Message) -> None:
    whole = encode(msg)
    for pos in range(HEADER.size, len(whole), max(1, len(whole) // 7)):
        bad = bytearray(whole)
        bad[pos] ^= 0x40
        with pytest.raises(WireError, match="checksum mismatch"):
            decode(bytes(bad))
    for cut in (HEADER.size - 1, HEADER.size + 1, len(whole) - 1):
        with pytest.raises(WireError, match="truncated"):
            decode(whole[:cut])


@pytest.mark.parametrize("msg", KV, ids=lambda m: type(m).__name__)
def test_a_frame_of_an_older_protocol_is_refused(msg: Message) -> None:
    raw = bytearray(encode(msg))
    for old in (5, 6):  # 6: a pull without its start slot
        raw[2] = old
        with pytest.raises(WireError, match=f"protocol version {old}, expected {PROTOCOL}"):
            decode(bytes(raw))


@pytest.mark.parametrize("build,message", [
    (lambda: KvPart(1, 2, 3, "k", np.zeros((1, 3, 9, 64), np.float64)), "state is f8"),
    (lambda: KvPart(1, 2, 3, "k", np.zeros((1, 3, 9, 64), np.complex64)), "cannot travel"),
])
def test_what_does_not_fit_cannot_be_sent(build: Any, message: str) -> None:
    with pytest.raises(WireError, match=f"cannot send KvPart: .*{message}"):
        encode(build())


@pytest.mark.parametrize("build", [
    lambda: KvPull(-1, 0), lambda: KvPush(1, 0, 0, 0, 1), lambda: KvPush(1, 0, 1, 0, 0),
    lambda: KvPart(1, 3, 2, "k", K), lambda: KvPart(1, 0, 0, "", K), lambda: KvDone(1, -1, ""),
    lambda: KvCopy(1, 4, 4, 0, np.arange(3)), lambda: KvCopy(1, 4, 5, 0, np.array([-1])),
    lambda: KvPush(1, 0, 2, 9, 4),  # a push opens one row (protocol 11)
    lambda: KvCopy(1, 4, 5, 0, np.zeros(16384, np.int64)),  # the audit's copy: slot 0 16,384 times
    lambda: KvCopy(1, 4, 5, 0, np.array([0, 2, 1])),  # out of order
    # paged moves (protocol 14): blocks distinct and in range, some tokens, a pull from slot 0
    lambda: KvPull(1, 4, 0, np.array([1, 1], np.int32), 5), lambda: KvPull(1, 4, 0, np.array([-1], np.int32), 5),
    lambda: KvPull(1, 4, 0, np.array([MAX_BLOCKS], np.int32), 5), lambda: KvPull(1, 4, 0, np.zeros(0, np.int32), 5),
    lambda: KvPull(1, 4, 0, np.array([1], np.int32), 0), lambda: KvPull(1, 4, 3, np.array([1], np.int32), 5),
    lambda: KvPull(1, 4, 0, None, 5), lambda: KvPush(1, 4, 1, 0, 2, np.array([1], np.int32)),
    lambda: KvPush(1, 4, 1, 5, 2, np.array([2, 2], np.int32)),
    # more blocks than tokens: a small frame naming a pool's worth of blocks
    lambda: KvPull(1, 4, 0, np.arange(6, dtype=np.int32), 5),
    lambda: KvPush(1, 4, 1, 5, 2, np.arange(6, dtype=np.int32)),
])
def test_our_own_messages_are_checked_when_made(build: Any) -> None:
    with pytest.raises(ValueError):
        build()
