"""Wire messages: every message round-trips; truncated, corrupt and malformed frames are refused,
and so is every field whose value does not fit its declared type (on decode: the peer's frame; on
encode: our own bug, before anything is sent)."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from shardline.config import SamplingParams
from shardline.wire.codec import HEADER, MAGIC, MAX_META, WireError, decode, encode
from shardline.wire.messages import (
    MESSAGES,
    PROTOCOL,
    Activations,
    Forward,
    Hello,
    KvCopy,
    KvDone,
    KvPart,
    KvPull,
    KvPush,
    Message,
    Phase,
    Ping,
    Pong,
    Ragged,
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
from shardline.wire.schema import CODES, SCHEMAS

rng = np.random.default_rng(0)
HOPS = np.array([[0, 0.0071, 0.0, 0.0002, 0.00002], [1, 0.0069, 0.00005, 0.0001, 0.00003]])
I64 = np.int64


def _mask(*rows: str) -> np.ndarray:
    return np.array([[int(c) for c in r] for r in rows], I64)


PREFILL = Forward(7, 3, Phase.PREFILL, True, 5, False, False, [SamplingParams(0.0, 0, 1.0, 1, 0)], np.array([7], I64),
                  np.zeros(0, I64), np.zeros(0, I64), rng.standard_normal((1, 5, 576)).astype(np.float16),
                  mask_to_runs(np.ones((1, 5))), np.arange(5, dtype=I64)[None], np.zeros((0, 2), I64), None, None,
                  None, None, None, HOPS[:1])
# A correction and three drafts verified in one step; two earlier rejected drafts are masked out
# (and dropped first: compact); the drafts were drawn from distributions whose supports travel.
VERIFY = Forward(7, 4, Phase.DECODE, False, 12, True, True, [SamplingParams(0.7, 40, 0.9, 5, 3)], np.array([7], I64),
                 np.zeros(0, I64), np.zeros(0, I64), rng.standard_normal((1, 4, 576)).astype(np.float32),
                 mask_to_runs(_mask("111111001111")), np.arange(6, 10, dtype=I64)[None],
                 np.array([[0, 0], [0, 1], [0, 2], [0, 3]], I64), np.array([11, 12, 13, -1], I64),
                 np.array([[11, 5], [12, -1], [13, 2], [-1, -1]], I64),
                 np.array([[0.75, 0.25], [1, 0], [0.5, 0.5], [0, 0]], np.float32), None, None, np.zeros((0, 5)))
# A decode group: rows 1 and 0 of its state kept in that order, stream 4's own KV merged after them.
GROUP = Forward(-1, 5, Phase.DECODE, False, 6, False, False,
                [SamplingParams(), SamplingParams(temperature=0.5, seed=9), SamplingParams(top_p=0.5)],
                np.array([3, 9, 4], I64), np.array([1, 0], I64), np.array([4], I64),
                rng.standard_normal((3, 1, 576)).astype(np.float16),
                mask_to_runs(_mask("111111", "001111", "000011")), np.array([[5], [3], [1]], I64),
                np.array([[0, 0], [1, 0], [2, 0]], I64), None, None, None,
                # row 1 constrained (a grammar's mask over a 70-token vocabulary), rows 0 and 2 free
                np.array([[-1, 0b101, 0]], np.int32), np.array([-1, 0, -1], I64), HOPS[:1])
I32 = np.int32
# A paged step (blocks of 16 tokens): stream 7 decodes a token after 40 (blocks 0-2), stream 9
# verifies a correction and two drafts after 17 (every position sampled; blocks 3-4), stream 4
# runs a first prompt chunk of 5 tokens that samples nothing (block 5).
RAGGED = Ragged(8, Phase.PREFILL, False, [SamplingParams(), SamplingParams(0.7, 40, 0.9, 5, 3), SamplingParams()],
                np.array([7, 9, 4], I64), rng.standard_normal((9, 576)).astype(np.float16),
                np.array([40, 17, 18, 19, 0, 1, 2, 3, 4], I64), np.array([40, 17, 0], I32),
                np.array([0, 1, 4, 9], I32), np.array([0, 1, 2, 3, 4, 5], I32), np.array([0, 3, 5, 6], I32),
                np.array([[0, 0], [1, 0], [1, 1], [1, 2]], I64), np.array([-1, 11, 12, -1], I64),
                np.array([[-1, -1], [11, 5], [12, -1], [-1, -1]], I64),
                np.array([[0, 0], [0.75, 0.25], [1, 0], [0, 0]], np.float32), None, None, HOPS[:1])
# Two decoding streams, the second constrained (a grammar's mask), every logits row wanted;
# stream 8's table holds blocks 2 and 9 (32 tokens written, its 33rd is new).
RAGGED_MASKED = Ragged(9, Phase.DECODE, True, [SamplingParams(), SamplingParams(temperature=0.5, seed=9)],
                       np.array([3, 8], I64), rng.standard_normal((2, 64)).astype(np.float32),
                       np.array([5, 32], I64), np.array([5, 32], I32), np.array([0, 1, 2], I32),
                       np.array([7, 2, 9], I32), np.array([0, 1, 3], I32), np.array([[0, 0], [1, 0]], I64),
                       None, None, None, np.array([[-1, 0b101, 0]], I32), np.array([-1, 0], I64), HOPS)
SAMPLES: list[Message] = [
    Hello(PROTOCOL, Role.WORKER, "ab" * 32, 15, 29, "gguf", Activations.ANY, "", 8192, "CPU,NPU"),
    Hello(PROTOCOL, Role.COORDINATOR, "ab" * 32, 0, 14, "gguf", Activations.F16, "0f" * 16, 131072),
    Refuse("model hash mismatch: worker has x, coordinator has y"),
    StepFailed(7, 4, "unknown key 7"),
    Release(7),
    PREFILL,
    VERIFY,
    GROUP,
    Sampled(7, 4, np.array([42], I64), np.array([-0.25], np.float32), None, None, None, None, HOPS),
    Sampled(7, 4, np.array([42, 7], I64), np.array([-0.25, -1.5], np.float32),
            np.array([[42, 3, 9], [7, -1, -1]], I64), np.array([[-0.25, -2, -3], [-1.5, -np.inf, -np.inf]], np.float32),
            None, None, HOPS),
    Sampled(7, 4, np.array([42], I64), np.array([-0.25], np.float32), None, None,
            rng.standard_normal((1, 49152)).astype(np.float32), None, HOPS),
    Sampled(7, 4, np.array([42, -1], I64), np.array([-0.25, 0], np.float32), None, None, None,
            np.array([-1, 1], np.int32), HOPS),  # entry 1 could not be sampled: its stream fails alone
    ShardRequest("stage1.bin"),
    ShardChunk("stage1.bin", 1024, 4096, "cd" * 32, np.arange(256, dtype=np.uint8)),
    Route("127.0.0.1:7001"),
    KvPull(11, 7),
    KvPush(12, 7, 1, 9, 4),
    KvPart(12, 15, 29, "past.15.key", rng.standard_normal((1, 3, 9, 64)).astype(np.float32)),
    KvDone(11, 4, ""),
    KvCopy(13, 7, 8, 0, np.arange(12, dtype=np.int64)),
    Ping(14),
    Pong(14),
    Hello(PROTOCOL, Role.COORDINATOR, "ab" * 32, 0, 14, "gguf", Activations.F16, "0f" * 16, 8192, "CPU", 32, 300),
    RAGGED,
    RAGGED_MASKED,
]


def equal(a: Message, b: Message) -> bool:
    """Same class, same field values; arrays of the same dtype, shape and bits."""
    if type(a) is not type(b):
        return False
    for k, v in vars(a).items():
        w = vars(b)[k]
        if isinstance(v, np.ndarray):
            if not (isinstance(w, np.ndarray) and v.dtype == w.dtype and v.shape == w.shape
                    and v.tobytes() == w.tobytes()):
                return False
        elif v != w or type(v) is not type(w):
            return False
    return True


def frame(kind: int, payload: bytes, magic: bytes = MAGIC, version: int = PROTOCOL) -> bytes:
    """A well-framed frame (right length and checksum) around any payload."""
    return HEADER.pack(magic, version, kind, len(payload), zlib.crc32(payload)) + payload


def meta_bytes(d: Any) -> bytes:
    raw = json.dumps(d, separators=(",", ":")).encode()
    return struct.pack("<I", len(raw)) + raw


def text_meta(text: str) -> bytes:
    """Raw JSON text as the JSON part of a payload."""
    return struct.pack("<I", len(text.encode())) + text.encode()


def array_bytes(a: np.ndarray | None, code: int | None = None) -> bytes:
    """An array as it travels, with any dtype code (by default its own)."""
    if a is None:
        return b"\x00"
    code = CODES[a.dtype] if code is None else code
    return struct.pack(f"<BBB{a.ndim}I", 1, code, a.ndim, *a.shape) + a.tobytes()


def split(msg: Message) -> tuple[dict[str, Any], dict[str, np.ndarray | None]]:
    """A message's JSON fields (as the peer sends them) and its arrays."""
    payload = encode(msg)[HEADER.size:]
    (n,) = struct.unpack_from("<I", payload)
    arrays = {a.name: getattr(msg, a.name) for a in SCHEMAS[type(msg).KIND].arrays}
    return json.loads(payload[4 : 4 + n]), arrays


def rebuild(msg: Message, meta: Any = None, *, text: str | None = None, arrays: dict[str, bytes] | None = None
            ) -> bytes:
    """`msg`'s frame with its JSON fields replaced by `meta` (or by raw JSON `text`) and any of
    its arrays by raw bytes."""
    fields, own = split(msg)
    arrays = arrays or {}
    body = b"".join(arrays[k] if k in arrays else array_bytes(a) for k, a in own.items())
    head = meta_bytes(fields if meta is None else meta) if text is None else text_meta(text)
    return frame(type(msg).KIND, head + body)


def test_every_message_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    got = decode(encode(msg))
    assert equal(got, msg)
    assert rebuild(msg) == encode(msg)  # the test's own framing agrees with the codec's


def test_decoded_fields_have_their_declared_types() -> None:
    hello, group = decode(encode(SAMPLES[0])), decode(encode(GROUP))
    assert isinstance(hello, Hello) and type(hello.role) is Role and type(hello.activations) is Activations
    assert isinstance(group, Forward) and group.phase is Phase.DECODE
    assert group.sampling == GROUP.sampling and all(type(s) is SamplingParams for s in group.sampling)


def test_plain_strings_for_enums_travel_as_their_values() -> None:
    msg = Hello(PROTOCOL, "worker", "m", 1, 2, "int8", "f32", "", 4096)  # type: ignore[arg-type]
    got = decode(encode(msg))
    assert isinstance(got, Hello) and got.role is Role.WORKER and got.activations is Activations.F32


@pytest.mark.parametrize("msg", [SAMPLES[4], PREFILL, SAMPLES[9]], ids=lambda m: type(m).__name__)
def test_every_truncation_is_refused(msg: Message) -> None:
    whole = encode(msg)
    for cut in sorted({0, 1, 5, HEADER.size - 1, HEADER.size, HEADER.size + 3, len(whole) // 2, len(whole) - 1}):
        with pytest.raises(WireError, match="truncated"):
            decode(whole[:cut])


def test_flipped_bits_are_refused() -> None:
    whole = bytearray(encode(PREFILL))
    for pos in range(HEADER.size, len(whole), 97):
        bad = bytearray(whole)
        bad[pos] ^= 0x10
        with pytest.raises(WireError, match="checksum mismatch"):
            decode(bytes(bad))


@pytest.mark.parametrize("raw,message", [
    (frame(4, meta_bytes({"key": 1}), magic=b"HT"), "bad magic"),
    (frame(4, meta_bytes({"key": 1}), version=99), "protocol version 99"),
    (frame(200, meta_bytes({"key": 1})), "unknown message kind 200"),
    (frame(4, meta_bytes({"key": 1, "extra": 2})), "malformed Release: fields"),
    (frame(4, meta_bytes({})), "malformed Release: fields"),
    (frame(4, meta_bytes({"key": 1}) + b"junk"), "trailing bytes"),
    (frame(4, meta_bytes([1])), "a JSON list, not an object"),
    (frame(2, struct.pack("<I", 50) + b"{}"), "malformed Refuse: fields of 50 bytes"),
    (frame(2, struct.pack("<I", 4) + b"\xff\xfe{}"), "malformed Refuse"),
    (frame(2, b"\x01\x00"), "malformed Refuse"),
    (frame(2, struct.pack("<I", MAX_META + 1) + b" " * (MAX_META + 1)), "fields of"),
    (frame(2, meta_bytes({"reason": "x"})[:4] + b"[" * 5000), "malformed Refuse"),  # nested past recursion
    (frame(8, meta_bytes({"name": "a", "offset": 0, "total": 1, "sha256": "x"}) + struct.pack("<BBBI", 1, 5, 1, 100)),
     "runs past the end"),
    (frame(8, meta_bytes({"name": "a", "offset": 0, "total": 1, "sha256": "x"}) + struct.pack("<BBB", 1, 77, 0)),
     "bad array header"),
    (frame(8, meta_bytes({"name": "a", "offset": 0, "total": 1, "sha256": "x"})), "the payload ends before data"),
    (frame(8, meta_bytes({"name": "a", "offset": 0, "total": 1, "sha256": "x"}) + b"\x01\x05"), "malformed"),
])
def test_malformed_frames_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(raw)


def test_deeply_nested_json_is_refused() -> None:
    raw = b"[" * 100_000
    with pytest.raises(WireError, match="malformed Refuse"):
        decode(frame(2, struct.pack("<I", len(raw)) + raw))


# --- typed decode: a well-framed frame whose field does not fit its type -----------------------


def _with(msg: Message, **changes: Any) -> dict[str, Any]:
    fields, _ = split(msg)
    return fields | changes


def _sampling(**changes: Any) -> list[dict[str, Any]]:
    return [dict(vars(SamplingParams())) | changes]


@pytest.mark.parametrize("msg,meta,message", [
    (SAMPLES[4], {"key": True}, "key: True is not an integer"),
    (SAMPLES[4], {"key": 1.0}, "key: 1.0 is not an integer"),
    (SAMPLES[4], {"key": "1"}, "key: '1' is not an integer"),
    (SAMPLES[4], {"key": 1 << 63}, "outside the 64-bit range"),
    (SAMPLES[4], {"key": None}, "not an integer"),
    (SAMPLES[2], {"reason": 3}, "reason: 3 is not a string"),
    (SAMPLES[2], {"reason": "\ud800"}, "not valid Unicode"),
    (SAMPLES[0], _with(SAMPLES[0], role="queen"), "role: 'queen' is not one of coordinator, worker"),
    (SAMPLES[0], _with(SAMPLES[0], activations="F16"), "activations: 'F16' is not one of"),
    (SAMPLES[0], _with(SAMPLES[0], first_layer=30), "bad layer range"),  # __post_init__
    (SAMPLES[0], _with(SAMPLES[0], session="x" * 65), "oversized Hello field"),
    (SAMPLES[0], _with(SAMPLES[0], context=0), "context 0 outside 1-16777216"),
    (SAMPLES[0], _with(SAMPLES[0], context=-4096), "context -4096 outside"),
    (SAMPLES[0], _with(SAMPLES[0], context=1 << 40), "outside 1-16777216"),
    (SAMPLES[0], _with(SAMPLES[0], context="8192"), "context: '8192' is not an integer"),
    (SAMPLES[0], _with(SAMPLES[0], device="NPU" * 90), "oversized or unprintable Hello.device"),
    (SAMPLES[0], _with(SAMPLES[0], device="CPU\x1b[2J"), "oversized or unprintable Hello.device"),
    (SAMPLES[0], _with(SAMPLES[0], device=7), "device: 7 is not a string"),
    (GROUP, _with(GROUP, first=0), "first: 0 is not true or false"),
    (GROUP, _with(GROUP, want_logits=[]), "want_logits: \\[\\] is not true or false"),
    (GROUP, _with(GROUP, phase="verify"), "phase: 'verify' is not one of prefill, decode"),
    (GROUP, _with(GROUP, slots=6.5), "slots: 6.5 is not an integer"),
    (GROUP, _with(GROUP, slots=4), "mask run outside the mask"),
    (GROUP, _with(GROUP, sampling={}), "sampling: {} is not a list"),
    (GROUP, _with(GROUP, sampling=_sampling() * 2), "one stream and one sampling per row"),
    (GROUP, _with(GROUP, sampling=_sampling() * 2 + [1]), r"sampling: \[2\]: 1 is not a SamplingParams object"),
    (VERIFY, _with(VERIFY, sampling=_sampling(temperature="0")), r"sampling: \[0\]: .temperature: '0' is not a number"),
    (VERIFY, _with(VERIFY, sampling=_sampling(temperature=True)), "temperature: True is not a number"),
    (VERIFY, _with(VERIFY, sampling=_sampling(temperature=1e-9)), "SamplingParams: temperature must be 0"),
    (VERIFY, _with(VERIFY, sampling=_sampling(top_k=-1)), "top-k must be in"),
    (VERIFY, _with(VERIFY, sampling=_sampling(top_p=0)), "top-p must be in"),
    (VERIFY, _with(VERIFY, sampling=_sampling(seed=1.5)), "seed: 1.5 is not an integer"),
    (VERIFY, _with(VERIFY, sampling=_sampling(top_logprobs=99)), "top logprobs must be in"),
    (VERIFY, _with(VERIFY, sampling=[{"temperature": 0.0}]), "SamplingParams fields"),
    (VERIFY, _with(VERIFY, sampling=_sampling(colour=1)), "SamplingParams fields"),
    (ShardChunk("a", 0, 1, "x", np.zeros(1, np.uint8)), {"name": "a", "offset": 1, "total": 1, "sha256": "x"},
     "chunk outside its file"),
    (SAMPLES[-3], _with(SAMPLES[-3], block_size=-1), "Hello: blocks of -1 tokens, a pool of 300"),
    (SAMPLES[-3], _with(SAMPLES[-3], block_size=(1 << 16) + 1), "Hello: blocks of 65537 tokens"),
    (SAMPLES[-3], _with(SAMPLES[-3], blocks=(1 << 24) + 1), "Hello: blocks of 32 tokens, a pool of 16777217"),
    (SAMPLES[-3], _with(SAMPLES[-3], blocks=True), "blocks: True is not an integer"),
    (RAGGED, _with(RAGGED, sampling=_sampling() * 2), "one sampling and past length per sequence"),
    (RAGGED, _with(RAGGED, sampling=_sampling() * 4), "one sampling and past length per sequence"),
    (RAGGED, _with(RAGGED, phase="ragged"), "phase: 'ragged' is not one of prefill, decode"),
    (RAGGED, _with(RAGGED, want_logits=1), "want_logits: 1 is not true or false"),
])
def test_wrongly_typed_fields_are_refused(msg: Message, meta: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=f"malformed {type(msg).__name__}: .*{message}"):
        decode(rebuild(msg, meta))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_at_parse_time(text: str) -> None:
    fields = json.dumps(_with(VERIFY, sampling=_sampling(top_p=0.5))).replace("0.5", text)
    with pytest.raises(WireError, match=f"malformed Forward: {text} is not a number JSON allows"):
        decode(rebuild(VERIFY, text=fields))
    with pytest.raises(WireError, match=f"malformed Release: {text} is not a number"):  # even where no field is
        decode(frame(4, text_meta(f'{{"key":1,"x":[{text}]}}')))


@pytest.mark.parametrize("text", ["1e999", "-1E400"])
def test_numbers_that_overflow_are_refused(text: str) -> None:
    fields = json.dumps(_with(VERIFY, sampling=_sampling(top_p=0.5))).replace("0.5", text)
    with pytest.raises(WireError, match=r"malformed Forward: sampling: \[0\]: .top_p: -?inf is not finite"):
        decode(rebuild(VERIFY, text=fields))


def _hidden(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("msg,arrays,message", [
    (GROUP, {"hidden": array_bytes(_hidden("<i8", (3, 1, 576)))}, "hidden is i8 with 3 dims, not f2/f4 with 3"),
    (GROUP, {"hidden": array_bytes(_hidden("<f2", (3, 576)))}, "hidden is f2 with 2 dims"),
    (GROUP, {"hidden": array_bytes(_hidden("<f2", (1, 3, 1, 576)))}, "hidden is f2 with 4 dims"),
    (GROUP, {"hidden": array_bytes(None)}, "hidden is missing"),
    (GROUP, {"rows": array_bytes(np.array([3, 9, 4], np.int32))}, "rows is i4 with 1 dims, not i8"),
    (GROUP, {"hidden": array_bytes(_hidden("<f2", (2, 1, 576)))}, "one stream and one sampling per row"),
    (GROUP, {"mask_runs": array_bytes(np.array([[0, 3, 4]], np.int32))}, "mask run outside the mask"),
    (GROUP, {"mask_runs": array_bytes(np.array([[3, 0, 1]], np.int32))}, "mask run outside the mask"),
    (GROUP, {"mask_runs": array_bytes(np.array([[0, 2, 1], [0, 0, 1]], np.int32))}, "out of order"),
    (GROUP, {"mask_runs": array_bytes(np.array([[0, 0, 3]], np.int64))}, "mask_runs is i8"),
    (GROUP, {"sample_at": array_bytes(np.array([[0, 1]], I64))}, "sample position out of range"),
    (GROUP, {"keep": array_bytes(np.array([0, 0], I64))}, "a row kept or merged twice"),
    (GROUP, {"keep": array_bytes(np.array([0], I64))}, "3 rows, 1 kept and 1 merged"),
    (GROUP, {"position_ids": array_bytes(np.array([[5], [3], [-1]], I64))}, "positions out of range"),
    (GROUP, {"hops": array_bytes(np.zeros((1, 4)))}, "hops"),
    (VERIFY, {"drafts": array_bytes(None)}, "drafts come with their q support"),
    (VERIFY, {"drafts": array_bytes(np.array([11, 12, 13], I64))}, "drafts .* for 4 samples"),
    (VERIFY, {"drafts": array_bytes(np.array([11, 12, 99, -1], I64))}, "draft 99 offered outside its q support"),
    (VERIFY, {"drafts": array_bytes(np.array([11, 12, 13, -2], I64))}, "negative token ids"),
    (VERIFY, {"q_probs": array_bytes(np.full((4, 2), np.nan, np.float32))}, "q probabilities outside 0-1"),
    (VERIFY, {"q_probs": array_bytes(np.full((4, 2), 1.5, np.float32))}, "q probabilities outside 0-1"),
    (VERIFY, {"q_ids": array_bytes(np.zeros((4, 65), I64)), "q_probs": array_bytes(np.zeros((4, 65), np.float32))},
     "for 4 samples"),
    (VERIFY, {"q_ids": array_bytes(np.zeros((4, 2), np.int32))}, "q_ids is i4"),
    (GROUP, {"allow_bits": array_bytes(None)}, "allow_bits come with allow_of"),
    (GROUP, {"allow_of": array_bytes(np.array([-1, 1, -1], I64))}, "allow_of names a mask outside 0-0"),
    (GROUP, {"allow_of": array_bytes(np.array([-2, 0, -1], I64))}, "allow_of names a mask outside"),
    (GROUP, {"allow_of": array_bytes(np.array([0, 0], I64))}, "allow_of .* for 3 samples"),
    (GROUP, {"allow_bits": array_bytes(np.zeros((4, 3), np.int32))}, "token masks of shape .* for 3 samples"),
    (GROUP, {"allow_bits": array_bytes(np.zeros((1, 3), np.int64))}, "allow_bits is i8 with 2 dims, not i4"),
    (GROUP, {"allow_bits": array_bytes(np.zeros((1, (1 << 15) + 1), np.int32))}, "token masks of shape"),
    (SAMPLES[9], {"top_ids": array_bytes(None)}, "top ids and logprobs go together"),
    (SAMPLES[9], {"logprobs": array_bytes(np.zeros(2, np.float16))}, "logprobs is f2"),
    (SAMPLES[9], {"tokens": array_bytes(np.zeros(3, I64))}, "one logprob per token"),
    (SAMPLES[11], {"failed": array_bytes(np.array([-1, 3], np.int32))}, "failure codes out of range"),
    (SAMPLES[11], {"failed": array_bytes(np.array([-2, 0], np.int32))}, "failure codes out of range"),
    (SAMPLES[11], {"failed": array_bytes(np.array([0], np.int32))}, "one failure code per token"),
    (SAMPLES[11], {"failed": array_bytes(np.array([0, 1], I64))}, "failed is i8"),
    (SAMPLES[13], {"data": array_bytes(np.zeros(4, np.float32))}, "data is f4 with 1 dims, not u1"),
])
def test_wrong_arrays_are_refused(msg: Message, arrays: dict[str, bytes], message: str) -> None:
    with pytest.raises(WireError, match=f"malformed {type(msg).__name__}: .*{message}"):
        decode(rebuild(msg, arrays=arrays))


def _i4(*v: int) -> bytes:
    return array_bytes(np.array(v, I32))


def _i8(*v: int) -> bytes:
    return array_bytes(np.array(v, I64))


def _at(*v: tuple[int, int]) -> bytes:
    """sample_at of these (sequence, t)."""
    return array_bytes(np.array(v, I64).reshape(-1, 2))


@pytest.mark.parametrize("arrays,message", [
    ({"hidden": array_bytes(_hidden("<f2", (1, 9, 576)))}, "hidden is f2 with 3 dims, not f2/f4 with 2"),
    ({"hidden": array_bytes(_hidden("<f2", (2, 576)))}, r"Ragged: 3 sequences, hidden \(2, 576\)"),
    ({"hidden": array_bytes(_hidden("<f2", (0, 576)))}, r"Ragged: 3 sequences, hidden \(0, 576\)"),
    ({"streams": array_bytes(np.zeros(0, I64))}, "Ragged: 0 sequences"),
    ({"streams": _i8(7, 9, 7)}, "a stream twice in one step"),
    ({"streams": _i4(7, 9, 4)}, "streams is i4 with 1 dims, not i8"),
    ({"begins": _i4(1, 2, 4, 9)}, "Ragged.begins: each sequence takes at least one token, and they cover the batch"),
    ({"begins": _i4(0, 1, 4, 8)}, "Ragged.begins: each sequence takes at least one token"),
    ({"begins": _i4(0, 1, 4, 10)}, "Ragged.begins: each sequence takes at least one token"),
    ({"begins": _i4(0, 4, 4, 9)}, "Ragged.begins: each sequence takes at least one token"),  # stream 9: none
    ({"begins": _i4(0, 4, 1, 9)}, "Ragged.begins: each sequence takes at least one token"),
    ({"begins": _i4(0, 1, 9)}, "Ragged: starts of tokens and of tables number one more than the sequences"),
    ({"block_begins": _i4(0, 3, 2, 6)}, "Ragged.block_begins out of order"),
    ({"block_begins": _i4(0, 3, 5, 5)}, "Ragged.block_begins out of order"),  # block 5 in no table
    ({"block_begins": _i4(1, 3, 5, 6)}, "Ragged.block_begins out of order"),
    ({"block_begins": _i4(0, 3, 5, 6, 6)}, "starts of tokens and of tables number one more than the sequences"),
    ({"block_indices": _i4(0, 1, 2, 3, -4, 5)}, "Ragged.block_indices out of range 0-16777215"),
    ({"block_indices": _i4(0, 1, 2, 3, 4, 1 << 24)}, "Ragged.block_indices out of range 0-16777215"),
    ({"block_indices": _i8(0, 1, 2, 3, 4, 5)}, "block_indices is i8 with 1 dims, not i4 with 1"),
    ({"past_lens": _i4(40, -1, 0)}, "Ragged.past_lens out of range 0-16777215"),
    ({"past_lens": _i4(40, 17)}, "one sampling and past length per sequence"),
    ({"past_lens": _i8(40, 17, 0)}, "past_lens is i8 with 1 dims, not i4"),
    ({"positions": _i8(40, 17, 18, 19, 0, 1, 2, 3, -1)}, "Ragged.positions out of range 0-16777215"),
    ({"positions": _i8(40, 17, 18, 19, 0, 1, 2, 3)}, r"positions \(8,\) for 9 tokens"),
    ({"sample_at": _i8(3, 0, 1, 0, 1, 1, 1, 2)}, "sample_at is i8 with 1 dims, not i8 with 2"),
    ({"sample_at": _at((3, 0), (1, 0), (1, 1), (1, 2))}, "sample sequence out of range 0-2"),
    ({"sample_at": _at((-1, 0), (1, 0), (1, 1), (1, 2))}, "sample sequence out of range"),
    ({"sample_at": _at((0, 1), (1, 0), (1, 1), (1, 2))}, "a sample past its sequence's tokens"),
    ({"sample_at": _at((0, 0), (1, 0), (1, 1), (1, 3))}, "a sample past its sequence's tokens"),
    ({"sample_at": _at((0, -1), (1, 0), (1, 1), (1, 2))}, "a sample past its sequence's"),
    ({"sample_at": array_bytes(np.zeros((10, 2), I64))}, "Ragged.sample_at"),  # more samples than tokens
    ({"sample_at": array_bytes(np.zeros((4, 3), I64))}, "Ragged.sample_at"),
    ({"sample_at": _at((0, 0), (1, 0), (1, 1))}, "drafts .* for 3 samples"),
    ({"q_ids": array_bytes(None), "q_probs": array_bytes(None)}, "drafts come with their q support"),
    ({"drafts": array_bytes(None)}, "drafts come with their q support"),
    ({"drafts": _i8(-1, 11, 99, -1)}, "draft 99 offered outside its q support"),
    ({"allow_of": _i8(-1, 0, -1, -1)}, "allow_bits come with allow_of"),
    ({"hops": array_bytes(np.zeros((1, 4)))}, "hops"),
])
def test_wrong_ragged_arrays_are_refused(arrays: dict[str, bytes], message: str) -> None:
    with pytest.raises(WireError, match=f"malformed Ragged: .*{message}"):
        decode(rebuild(RAGGED, arrays=arrays))


@pytest.mark.parametrize("arrays,message", [
    ({"allow_bits": array_bytes(None)}, "allow_bits come with allow_of"),
    ({"allow_of": _i8(-1, 1)}, "allow_of names a mask outside 0-0"),
    ({"allow_of": _i8(-1, 0, -1)}, r"allow_of \(3,\) for 2 samples"),
    ({"allow_bits": array_bytes(np.zeros((3, 3), I32))}, "token masks of shape .* for 2 samples"),
    ({"allow_bits": array_bytes(np.zeros((1, 3), I64))}, "allow_bits is i8 with 2 dims, not i4"),
    ({"block_begins": _i4(0, 1, 2)}, "Ragged.block_begins out of order"),  # block 9 in no table
])
def test_wrong_masks_of_a_ragged_step_are_refused(arrays: dict[str, bytes], message: str) -> None:
    with pytest.raises(WireError, match=f"malformed Ragged: .*{message}"):
        decode(rebuild(RAGGED_MASKED, arrays=arrays))


# --- encode: our own bugs fail before anything is sent ------------------------------------------


def _past_checks(msg: Message, **changes: Any) -> Message:
    """`msg` with fields changed behind its own checks: what a bug of ours could send."""
    msg = copy.copy(msg)
    for k, v in changes.items():
        object.__setattr__(msg, k, v)
    return msg


@pytest.mark.parametrize("msg,message", [
    (Release(True), "key: True is not an integer"),
    (Release(np.int64(3)), "key: np.int64\\(3\\) is not an integer"),  # type: ignore[arg-type]
    (Refuse(None), "reason: None is not a string"),  # type: ignore[arg-type]
    (Hello(PROTOCOL, "queen", "m", 1, 2, "int8", "f32", "", 4096), "role: 'queen' is not one of"),  # type: ignore[arg-type]
    (ShardChunk("a", 0, 4, "x", np.zeros(1, np.float32)), "data is f4 with 1 dims, not u1 with 1"),
    (ShardChunk("a", 0, 4, "x", np.zeros(3, dtype=np.complex64)), "dtype complex64 cannot travel"),
    (_past_checks(ShardChunk("a", 0, 4, "x", np.zeros(1, np.uint8)), data=[1, 2]), "data is a list, not an array"),
    (_past_checks(SAMPLES[8], hops=None), "hops is missing"),
])
def test_what_does_not_fit_cannot_be_sent(msg: Message, message: str) -> None:
    with pytest.raises(WireError, match=f"cannot send {type(msg).__name__}: .*{message}"):
        encode(msg)


def test_a_nan_cannot_be_sent() -> None:
    params = _past_checks(SamplingParams(), top_p=float("nan"))  # type: ignore[arg-type]
    with pytest.raises(WireError, match=r"cannot send Forward: sampling: \[0\]: .top_p: nan is not finite"):
        encode(Forward(**(vars(VERIFY) | {"sampling": [params]})))


def test_big_endian_arrays_travel_little_endian() -> None:
    msg = ShardChunk("a", 0, 4, "x", np.arange(4, dtype=np.uint8))
    sampled = Sampled(1, 2, np.arange(2, dtype=">i8"), np.zeros(2, ">f4"), None, None, None, None,
                      HOPS.astype(">f8"))
    assert equal(decode(encode(msg)), msg)
    got = decode(encode(sampled))
    assert isinstance(got, Sampled) and got.tokens.dtype == np.dtype("<i8") and list(got.tokens) == [0, 1]


def test_a_frame_of_the_previous_protocol_is_refused() -> None:
    raw = bytearray(encode(GROUP))
    raw[2] = 3  # version 3: no sample positions, masks as 0/1 arrays
    with pytest.raises(WireError, match=f"protocol version 3, expected {PROTOCOL}"):
        decode(bytes(raw))


@pytest.mark.parametrize("msg", [PREFILL, GROUP, SAMPLES[8], SAMPLES[10], RAGGED, RAGGED_MASKED],
                         ids=lambda m: type(m).__name__)
def test_stamp_writes_the_encode_time_into_the_senders_own_slot(msg: Message) -> None:
    got = decode(encode(msg, stamp=True))
    assert isinstance(got, Forward | Sampled | Ragged) and isinstance(msg, Forward | Sampled | Ragged)
    stamped = got.hops[-1, -1]
    assert 0 < stamped < 0.05 and stamped != msg.hops[-1, -1]
    assert np.array_equal(got.hops.ravel()[:-1], msg.hops.ravel()[:-1])  # every other duration as sent
    assert equal(got, msg) is False and equal(decode(encode(msg)), msg)


@pytest.mark.parametrize("msg", [VERIFY, Release(1), dataclasses.replace(RAGGED, hops=np.zeros((0, 5)))],
                         ids=["no rows", "no hops", "ragged, no rows"])
def test_stamp_needs_an_f64_row(msg: Message) -> None:
    with pytest.raises(WireError, match="has no f64 hops row to stamp its encode time into"):
        encode(msg, stamp=True)


@pytest.mark.parametrize("msg", [GROUP, PREFILL], ids=["merge", "first"])
def test_a_step_that_merges_or_opens_cannot_also_compact(msg: Forward) -> None:
    fields, _ = split(msg)
    with pytest.raises(WireError, match="cannot also compact"):
        decode(rebuild(msg, {**fields, "compact": True}))
