"""Property tests of the wire: nothing a peer sends gets past the codec or a link but well-typed
messages, and nothing but WireError (or LinkClosed, from a link) comes out of them.

(a) random valid messages of every kind round-trip exactly; (b) every field of every message,
replaced by a value of the wrong type, the wrong dtype or ndim, missing, or out of range, is
refused; (c) garbage, random payloads behind valid headers, and mutated valid frames only ever
raise WireError, and whatever does decode is well typed; (d) the same through real sockets, plus
half-sent frames and oversized headers; and the run-length mask helpers.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import time
import tracemalloc
import zlib
from enum import StrEnum
from typing import Any, get_args, get_origin, get_type_hints

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shardline.config import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SamplingParams
from shardline.errors import Unsampleable
from shardline.wire.codec import HEADER, MAGIC, WireError, decode, encode
from shardline.wire.link import HANDSHAKE_PAYLOAD, Link, LinkClosed, TimedOut
from shardline.wire.messages import (
    HOP_COLUMNS,
    MAX_BLOCKS,
    MAX_KV_PARTS,
    MAX_NAME,
    MAX_ROWS,
    MAX_SLOTS,
    MESSAGES,
    PROTOCOL,
    Activations,
    Arr,
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
    check_runs,
    mask_to_runs,
    runs_to_mask,
)
from shardline.wire.schema import DTYPES
from tests.unit.test_wire import SAMPLES, array_bytes, equal, frame, rebuild, split

FUZZ = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
SOCKETS = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

# --- strategies: valid messages ------------------------------------------------------------------

i64 = st.integers(I64_MIN, I64_MAX)
text = st.text(max_size=24)
sampling = st.builds(
    SamplingParams,
    temperature=st.just(0.0) | st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE),
    top_k=st.integers(0, MAX_TOP_K), top_p=st.floats(0, 1, exclude_min=True), seed=st.integers(0, MAX_SEED),
    top_logprobs=st.integers(0, MAX_TOP_LOGPROBS))


def arrays(dtype: str, shape: tuple[int, ...], low: int | None = None, high: int | None = None) -> Any:
    """Any bits for floats (NaN and infinities travel as bytes); ints in [low, high] if given."""
    elements = st.integers(low, high) if low is not None else None
    return hnp.arrays(np.dtype(dtype), shape, elements=elements)


def hops() -> Any:
    return st.integers(0, 3).flatmap(lambda n: arrays("<f8", (n, len(HOP_COLUMNS))))


@st.composite
def forwards(draw: Any) -> Forward:
    b, t, width = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(0, 8))
    slots = draw(st.integers(t, t + 12))
    mask = draw(arrays("i1", (b, slots), 0, 1))
    kept = draw(st.none() | st.integers(0, b))  # None: keep and merge both empty
    keep = [] if kept is None else draw(st.lists(st.integers(0, MAX_ROWS - 1), min_size=kept, max_size=kept,
                                                 unique=True))
    merge = [] if kept is None else draw(st.lists(i64, min_size=b - kept, max_size=b - kept, unique=True))
    samples = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, t - 1)), max_size=b * t))
    first = b == 1 and draw(st.booleans())  # a key opens with one row
    compact = kept is None and not first and draw(st.booleans())
    e = len(samples)
    drafted = draw(st.booleans())
    support = draw(st.integers(1, 4))
    q_ids = np.array(draw(st.lists(st.lists(st.integers(0, 1000), min_size=support, max_size=support, unique=True),
                                   min_size=e, max_size=e)), np.int64).reshape(e, support)
    q_probs = np.full((e, support), 1.0 / support, np.float32)
    drafts = q_ids[:, 0].copy() if e else np.zeros(0, np.int64)
    return Forward(
        draw(i64), draw(i64), draw(st.sampled_from(Phase)), first, slots, draw(st.booleans()), compact,
        draw(st.lists(sampling, min_size=b, max_size=b)),
        np.array(draw(st.lists(i64, min_size=b, max_size=b, unique=True)), np.int64),
        np.array(keep, np.int64), np.array(merge, np.int64),
        draw(arrays(draw(st.sampled_from(["<f2", "<f4"])), (b, t, width))), mask_to_runs(mask),
        draw(arrays("<i8", (b, t), 0, MAX_SLOTS - 1)), np.array(samples, np.int64).reshape(-1, 2),
        drafts if drafted else None, q_ids if drafted else None, q_probs if drafted else None,
        *draw(token_masks(e)), draw(hops()))


@st.composite
def drafted(draw: Any, e: int) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """None, or per sampled entry a draft and its distribution's support (the draft inside it)."""
    if not draw(st.booleans()):
        return None, None, None
    support = draw(st.integers(1, 4))
    q_ids = np.array(draw(st.lists(st.lists(st.integers(0, 1000), min_size=support, max_size=support, unique=True),
                                   min_size=e, max_size=e)), np.int64).reshape(e, support)
    q_probs = np.full((e, support), 1.0 / support, np.float32)
    offered = np.array(draw(st.lists(st.booleans(), min_size=e, max_size=e)), bool)
    drafts = np.where(offered, q_ids[:, 0], -1) if e else np.zeros(0, np.int64)
    return drafts.astype(np.int64), q_ids, q_probs


@st.composite
def raggeds(draw: Any) -> Ragged:
    """A paged step: S sequences of 1-4 new tokens each after a past of their own, each over a
    block table that covers its tokens (distinct blocks of the pool), sampling any of them."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    s, t, width = len(lengths), sum(lengths), draw(st.integers(0, 8))
    past = draw(st.lists(st.integers(0, 600), min_size=s, max_size=s))
    block = draw(st.sampled_from([16, 32, 64, 128, 256]))
    tables = [-(-(p + n) // block) for p, n in zip(past, lengths, strict=True)]
    blocks = draw(st.lists(st.integers(0, MAX_BLOCKS - 1), min_size=sum(tables), max_size=sum(tables), unique=True))
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(past, lengths, strict=True)]).astype(np.int64)
    samples = draw(st.lists(st.integers(0, s - 1).flatmap(lambda q: st.tuples(st.just(q),
                                                                              st.integers(0, lengths[q] - 1))),
                            max_size=t))
    e = len(samples)
    return Ragged(
        draw(seqs), draw(st.sampled_from(Phase)), draw(st.booleans()), draw(st.lists(sampling, min_size=s, max_size=s)),
        np.array(draw(st.lists(i64, min_size=s, max_size=s, unique=True)), np.int64),
        draw(arrays(draw(st.sampled_from(["<f2", "<f4"])), (t, width))), positions, np.array(past, np.int32),
        np.cumsum([0, *lengths]).astype(np.int32), np.array(blocks, np.int32),
        np.cumsum([0, *tables]).astype(np.int32), np.array(samples, np.int64).reshape(-1, 2),
        *draw(drafted(e)), *draw(token_masks(e)), draw(hops()))


@st.composite
def token_masks(draw: Any, e: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """None, or up to one bitmask per sampled entry and which entries they limit."""
    if not draw(st.booleans()):
        return None, None
    m, words = draw(st.integers(0, e)), draw(st.integers(0, 5))
    which = draw(st.lists(st.integers(-1, m - 1), min_size=e, max_size=e)) if m else [-1] * e
    return draw(arrays("<i4", (m, words))), np.array(which, np.int64)


@st.composite
def sampleds(draw: Any) -> Sampled:
    e, n, vocab = draw(st.integers(0, 4)), draw(st.integers(0, 3)), draw(st.integers(0, 6))
    top = draw(st.booleans())
    return Sampled(draw(i64), draw(i64), draw(arrays("<i8", (e,))), draw(arrays("<f4", (e,))),
                   draw(arrays("<i8", (e, n))) if top else None, draw(arrays("<f4", (e, n))) if top else None,
                   draw(st.none() | arrays("<f4", (e, vocab))),
                   draw(st.none() | st.lists(st.integers(-1, len(Unsampleable.REASONS) - 1), min_size=e, max_size=e)
                        .map(lambda v: np.array(v, np.int32))), draw(hops()))


@st.composite
def chunks(draw: Any) -> ShardChunk:
    data = draw(arrays("u1", (draw(st.integers(0, 64)),)))
    offset = draw(st.integers(0, 1 << 40))
    return ShardChunk(draw(text), offset, draw(st.integers(offset + data.size, I64_MAX)), draw(text), data)


@st.composite
def hellos(draw: Any) -> Hello:
    first = draw(st.integers(0, (1 << 16) - 1))
    return Hello(draw(i64), draw(st.sampled_from(Role)), draw(st.text(max_size=128)), first,
                 draw(st.integers(first, (1 << 16) - 1)), draw(st.text(max_size=32)),
                 draw(st.sampled_from(Activations)), draw(st.text(max_size=64)), draw(st.integers(1, 1 << 24)),
                 block_size=draw(st.just(0) | st.integers(1, 1 << 16)), blocks=draw(st.integers(0, MAX_BLOCKS)))


seqs = st.integers(0, I64_MAX)


@st.composite
def kv_parts(draw: Any) -> KvPart:
    first = draw(st.integers(0, (1 << 16) - 1))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 5)), draw(st.integers(1, 4)))
    name = draw(st.text(min_size=1, max_size=MAX_NAME))
    return KvPart(draw(seqs), first, draw(st.integers(first, (1 << 16) - 1)), name,
                  draw(arrays(draw(st.sampled_from(["<f4", "<f2"])), shape)))


@st.composite
def kv_copies(draw: Any) -> KvCopy:
    src = draw(i64)
    dst = draw(i64.filter(lambda k: k != src))
    index = np.array(sorted(draw(st.sets(st.integers(0, MAX_SLOTS - 1), min_size=1, max_size=8))), np.int64)
    return KvCopy(draw(seqs), src, dst, draw(st.integers(0, MAX_ROWS - 1)), index)


# a paged move's blocks: distinct ids of a pool (at most 12: each holds at least one of its tokens)
block_lists = st.lists(st.integers(0, MAX_BLOCKS - 1), min_size=1, max_size=12, unique=True).map(
    lambda ids: np.asarray(ids, np.int32))

MESSAGE_STRATEGIES: dict[type, Any] = {
    Hello: hellos(), Refuse: st.builds(Refuse, text), StepFailed: st.builds(StepFailed, i64, i64, text),
    Release: st.builds(Release, i64), Forward: forwards(), Sampled: sampleds(),
    ShardRequest: st.builds(ShardRequest, text), ShardChunk: chunks(), Route: st.builds(Route, text),
    KvPull: st.builds(KvPull, seqs, i64) | st.builds(KvPull, seqs, i64, st.just(0), block_lists,
                                                     st.integers(12, MAX_SLOTS)),
    KvPush: st.builds(KvPush, seqs, i64, st.just(1), st.integers(0, MAX_SLOTS), st.integers(1, MAX_KV_PARTS))
    | st.builds(KvPush, seqs, i64, st.just(1), st.integers(12, MAX_SLOTS), st.integers(1, MAX_KV_PARTS),
                block_lists),
    KvPart: kv_parts(), KvDone: st.builds(KvDone, seqs, st.integers(0, MAX_KV_PARTS), text), KvCopy: kv_copies(),
    Ping: st.builds(Ping, seqs), Pong: st.builds(Pong, seqs), Ragged: raggeds(),
}
messages = st.one_of(*MESSAGE_STRATEGIES.values())

# --- what a well-typed message is, written independently of the codec ---------------------------


def _typed(hint: Any, v: Any) -> bool:
    if hint in (int, bool, str):
        return type(v) is hint and (hint is not int or I64_MIN <= v <= I64_MAX)
    if hint is float:
        return type(v) is float and np.isfinite(v)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return type(v) is hint
    if get_origin(hint) is list:
        return type(v) is list and all(_typed(get_args(hint)[0], x) for x in v)
    assert dataclasses.is_dataclass(hint), hint
    return type(v) is hint and all(_typed(h, getattr(v, k)) for k, h in get_type_hints(hint).items())


def _array_fits(spec: Arr, a: Any) -> bool:
    if a is None:
        return spec.optional
    allowed = {np.dtype(d).newbyteorder("<") for d in spec.dtypes}
    return isinstance(a, np.ndarray) and a.dtype in allowed and a.ndim == spec.ndim


def well_typed(msg: Message) -> bool:
    cls = type(msg)
    return all(_array_fits(cls.ARRAYS[k], getattr(msg, k)) if k in cls.ARRAYS else _typed(h, getattr(msg, k))
               for k, h in get_type_hints(cls).items() if k not in ("KIND", "ARRAYS"))


def decodes_or_refuses(raw: bytes) -> Message | None:
    """The message, well typed; or None for a WireError. Any other exception fails the test."""
    try:
        msg = decode(raw)
    except WireError:
        return None
    assert well_typed(msg), msg
    return msg


# --- (a) valid messages round-trip ---------------------------------------------------------------


def test_every_kind_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(MESSAGES.values())


@FUZZ
@given(messages)
def test_valid_messages_round_trip_exactly(msg: Message) -> None:
    got = decode(encode(msg))
    assert equal(got, msg) and well_typed(got)


ONE_HOP = np.ones((1, len(HOP_COLUMNS)))


@FUZZ
@given(st.one_of(forwards(), sampleds(), raggeds()).map(
    lambda m: m if m.hops.size else dataclasses.replace(m, hops=ONE_HOP)))
def test_stamped_messages_round_trip_but_for_the_stamp(msg: Forward | Sampled | Ragged) -> None:
    got = decode(encode(msg, stamp=True))
    assert isinstance(got, Forward | Sampled | Ragged)
    assert got.hops.ravel()[:-1].tobytes() == msg.hops.ravel()[:-1].tobytes() and 0 <= got.hops[-1, -1] < 1
    assert equal(dataclasses.replace(got, hops=msg.hops), msg)


# --- (b) every field, wrongly typed or out of range, is refused ---------------------------------

NOT: dict[Any, list[Any]] = {  # JSON values that are not of the type
    int: [True, False, 1.0, 1.5, "1", None, [], {}, [1], 1 << 63, -(1 << 63) - 1],
    float: [True, "0.5", None, [], {}, [0.5], 1 << 64],
    str: [1, 1.5, True, None, [], {}, ["a"], "\ud800"],
    bool: [0, 1, 1.0, "true", None, [], {}, [True]],
}
OUT_OF_RANGE: dict[str, list[Any]] = {
    "temperature": [-1.0, 1e-9, MAX_TEMPERATURE * 2], "top_k": [-1, MAX_TOP_K + 1], "top_p": [0.0, -0.5, 1.5],
    "seed": [-1, MAX_SEED + 1], "top_logprobs": [-1, MAX_TOP_LOGPROBS + 1],
}


def _not_of(hint: Any) -> list[Any]:
    if hint in NOT:
        return NOT[hint]
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return ["", "nope", [m.value for m in hint][0].upper(), 1, True, None, [], {}]
    assert get_origin(hint) is list and get_args(hint)[0] is SamplingParams, hint
    return ["x", {}, None, 1, [None], [1], [[]], ["x"]]


def _bad_sampling(good: dict[str, Any]) -> list[Any]:
    """Entries of a sampling list that are not SamplingParams: mistyped, out of range, incomplete."""
    hints = get_type_hints(SamplingParams)
    out: list[Any] = [{}, {k: v for k, v in good.items() if k != "seed"}, good | {"colour": 1}]
    out += [good | {k: v} for k, h in hints.items() for v in NOT[h]]
    out += [good | {k: v} for k, vs in OUT_OF_RANGE.items() for v in vs]
    return out


def _wrong_fields(msg: Message) -> list[tuple[str, Any]]:
    fields, _ = split(msg)
    hints = get_type_hints(type(msg))
    cases = [(name, v) for name in fields for v in _not_of(hints[name])]
    if "sampling" in fields:
        cases += [("sampling", [bad] + fields["sampling"][1:]) for bad in _bad_sampling(fields["sampling"][0])]
    return cases


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_json_field_of_the_wrong_type_is_refused(msg: Message) -> None:
    fields, _ = split(msg)
    cases = _wrong_fields(msg)
    cases += [(f"without {name}", {k: v for k, v in fields.items() if k != name}) for name in fields]
    for name, value in cases:
        meta = value if name.startswith("without") else fields | {name: value}
        with pytest.raises(WireError, match=f"malformed {type(msg).__name__}"):
            decode(rebuild(msg, meta))
    with pytest.raises(WireError, match="fields"):
        decode(rebuild(msg, fields | {"extra": 1}))


def _wrong_arrays(msg: Message) -> list[tuple[str, bytes]]:
    """Each array as another dtype, with one dimension fewer or more, missing, or a bad header."""
    spec = type(msg).ARRAYS
    cases = []
    for name, a in split(msg)[1].items():
        shape = a.shape if a is not None else (1,) * spec[name].ndim
        allowed = {np.dtype(d).newbyteorder("<") for d in spec[name].dtypes}
        cases += [(name, array_bytes(np.zeros(shape, dt))) for dt in DTYPES.values() if dt not in allowed]
        cases += [(name, array_bytes(np.zeros(shape[:-1], np.dtype(spec[name].dtypes[0]))))]
        cases += [(name, array_bytes(np.zeros((*shape, 1), np.dtype(spec[name].dtypes[0]))))]
        cases += [(name, struct.pack("<BBB", 1, code, 0)) for code in (0, 7, 255)]
        cases += [(name, b"\x02" + array_bytes(np.zeros(shape, np.dtype(spec[name].dtypes[0])))[1:])]
        if not spec[name].optional:
            cases.append((name, b"\x00"))
    return cases


@pytest.mark.parametrize("msg", [m for m in SAMPLES if type(m).ARRAYS], ids=lambda m: type(m).__name__)
def test_every_array_of_the_wrong_dtype_or_ndim_or_missing_is_refused(msg: Message) -> None:
    for name, raw in _wrong_arrays(msg):
        with pytest.raises(WireError, match=f"malformed {type(msg).__name__}"):
            decode(rebuild(msg, arrays={name: raw}))


def _forward_out_of_range(f: Forward) -> list[dict[str, Any]]:
    b, t = f.hidden.shape[:2]
    i4, i8 = np.int32, np.int64
    return [
        {"mask_runs": np.array([[b, 0, 1]], i4)}, {"mask_runs": np.array([[-1, 0, 1]], i4)},
        {"mask_runs": np.array([[0, -1, 2]], i4)}, {"mask_runs": np.array([[0, 0, 0]], i4)},
        {"mask_runs": np.array([[0, f.slots - 1, 2]], i4)}, {"mask_runs": np.array([[0, 0, 2], [0, 2, 1]], i4)},
        {"mask_runs": np.array([[0, 0, 2], [0, 1, 2]], i4)}, {"mask_runs": np.zeros((1, 2), i4)},
        {"sample_at": np.array([[b, 0]], i8)}, {"sample_at": np.array([[0, t]], i8)},
        {"sample_at": np.array([[-1, 0]], i8)}, {"sample_at": np.zeros((1, 3), i8)},
        {"position_ids": np.full((b, t), -1, i8)}, {"position_ids": np.full((b, t), MAX_SLOTS, i8)},
        {"position_ids": np.zeros((b, t + 1), i8)}, {"rows": np.zeros(b + 1, i8)},
        {"hidden": np.zeros((0, t, 8), np.float16)}, {"hidden": np.zeros((b, 0, 8), np.float16)},
        {"hops": np.zeros((1, len(HOP_COLUMNS) + 1))}, {"keep": np.array([-1] * b, i8), "merge": np.zeros(0, i8)},
        {"keep": np.array([MAX_ROWS] * b, i8), "merge": np.zeros(0, i8)},
        {"keep": np.zeros(b + 1, i8), "merge": np.zeros(0, i8)},
    ]


@pytest.mark.parametrize("msg", [m for m in SAMPLES if isinstance(m, Forward)], ids=lambda m: str(m.seq))
def test_forward_arrays_out_of_range_are_refused(msg: Forward) -> None:
    for change in _forward_out_of_range(msg):
        with pytest.raises(WireError, match="malformed Forward"):
            decode(rebuild(msg, arrays={k: array_bytes(a) for k, a in change.items()}))
    fields, _ = split(msg)
    for slots in (msg.hidden.shape[1] - 1, MAX_SLOTS + 1, -1):
        with pytest.raises(WireError, match="malformed Forward"):
            decode(rebuild(msg, fields | {"slots": slots}))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_any_json_in_any_field_is_refused_or_well_typed(msg: Message, data: Any) -> None:
    fields, _ = split(msg)
    name = data.draw(st.sampled_from(sorted(fields)))
    decodes_or_refuses(rebuild(msg, fields | {name: data.draw(json_values)}))


@FUZZ
@given(st.sampled_from([m for m in SAMPLES if type(m).ARRAYS]), st.data())
def test_any_bytes_for_an_array_are_refused_or_well_typed(msg: Message, data: Any) -> None:
    _, own = split(msg)
    name = data.draw(st.sampled_from(sorted(own)))
    head = data.draw(st.tuples(st.integers(0, 2), st.sampled_from([*DTYPES, 0, 9]), st.integers(0, 9)))
    dims = data.draw(st.lists(st.integers(0, 6), min_size=head[2], max_size=head[2]))
    body = data.draw(st.binary(max_size=200))
    decodes_or_refuses(rebuild(msg, arrays={name: struct.pack(f"<BBB{len(dims)}I", *head, *dims) + body}))


# --- (c) garbage, random payloads, mutated frames: only WireError --------------------------------


@FUZZ
@given(st.binary(max_size=512))
def test_garbage_bytes_only_raise_wire_error(raw: bytes) -> None:
    decodes_or_refuses(raw)
    decodes_or_refuses(HEADER.pack(MAGIC, PROTOCOL, 5, len(raw), zlib.crc32(raw)) + raw)


@FUZZ
@given(st.sampled_from(sorted(MESSAGES)), st.binary(max_size=512))
def test_a_valid_header_and_any_payload_only_raise_wire_error(kind: int, payload: bytes) -> None:
    decodes_or_refuses(frame(kind, payload))


@FUZZ
@given(st.sampled_from(sorted(MESSAGES)), json_values, st.binary(max_size=64))
def test_any_json_object_and_any_arrays_only_raise_wire_error(kind: int, meta: Any, tail: bytes) -> None:
    raw = json.dumps(meta).encode()
    decodes_or_refuses(frame(kind, struct.pack("<I", len(raw)) + raw + tail))


@FUZZ
@given(st.sampled_from(sorted(MESSAGES)), st.integers(1, 20_000), st.sampled_from("[{"), st.binary(max_size=8))
def test_deeply_nested_json_only_raises_wire_error(kind: int, depth: int, bracket: str, tail: bytes) -> None:
    raw = (bracket if bracket == "[" else '{"a":' * (depth - 1) + "{") * (depth if bracket == "[" else 1)
    decodes_or_refuses(frame(kind, struct.pack("<I", len(raw)) + raw.encode() + tail))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_prefix_of_a_payload_is_refused(msg: Message) -> None:
    """Cut anywhere (the checksum fixed): in the JSON, between or inside arrays."""
    payload = encode(msg)[HEADER.size:]
    for cut in [*range(min(len(payload), 700)), *range(700, len(payload), 997)]:
        with pytest.raises(WireError, match=f"malformed {type(msg).__name__}"):
            decode(frame(type(msg).KIND, payload[:cut]))


@FUZZ
@given(messages, st.data())
def test_mutated_frames_with_a_fixed_checksum_only_raise_wire_error(msg: Message, data: Any) -> None:
    payload = bytearray(encode(msg)[HEADER.size:])
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    decodes_or_refuses(frame(type(msg).KIND, bytes(payload[:cut] if data.draw(st.booleans()) else payload)))


# --- (d) through real sockets --------------------------------------------------------------------


def _drain(link: Link) -> BaseException:
    """Receive until something stops the link; it must be a WireError or LinkClosed."""
    while True:
        try:
            msg = link.recv()
        except (WireError, LinkClosed) as e:
            return e
        assert well_typed(msg)


@SOCKETS
@given(st.binary(max_size=2048) | messages.map(encode).flatmap(lambda f: st.just(f) | st.binary().map(f.__add__)))
def test_a_link_fed_garbage_raises_wire_error_or_link_closed(raw: bytes) -> None:
    c, d = socket.socketpair()
    with c, d:
        c.sendall(raw)
        c.shutdown(socket.SHUT_WR)
        _drain(Link(d, "garbage", frame_timeout=5))


@settings(deadline=None, max_examples=8)
@given(st.integers(1, len(encode(SAMPLES[7])) - 1))
def test_a_half_sent_frame_times_out(cut: int) -> None:
    c, d = socket.socketpair()
    with c, d:
        c.sendall(encode(SAMPLES[7])[:cut])
        start = time.monotonic()
        with pytest.raises(TimedOut, match="half sent"):
            Link(d, "half sent", frame_timeout=0.05).recv()
        assert time.monotonic() - start < 2


@SOCKETS
@given(st.sampled_from(sorted(MESSAGES)), st.integers(HANDSHAKE_PAYLOAD + 1, (1 << 32) - 1))
def test_an_oversized_header_before_the_handshake_allocates_nothing(kind: int, length: int) -> None:
    c, d = socket.socketpair()
    with c, d:
        c.sendall(HEADER.pack(MAGIC, PROTOCOL, kind, length, 0) + b"x" * 100)
        link = Link(d, "big")
        tracemalloc.start()
        try:
            with pytest.raises(WireError, match="announced a frame|exceeds the limit"):
                link.recv()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20 and len(link._buf) <= HANDSHAKE_PAYLOAD < length


# --- run-length masks ----------------------------------------------------------------------------


@FUZZ
@given(hnp.arrays(np.int64, st.tuples(st.integers(1, 6), st.integers(0, 40)), elements=st.integers(0, 3)))
def test_masks_round_trip_through_runs(mask: np.ndarray) -> None:
    b, width = mask.shape
    runs = mask_to_runs(mask)
    assert runs.dtype == np.int32 and runs.shape[1:] == (3,)
    check_runs(runs, b, width)
    assert np.array_equal(runs_to_mask(runs, b, width), (mask != 0).astype(np.int64))


@FUZZ
@given(st.integers(1, 4), st.integers(1, 12), hnp.arrays(np.int32, st.tuples(st.integers(0, 6), st.just(3)),
                                                         elements=st.integers(-2, 14)))
def test_runs_that_pass_the_check_are_exactly_a_mask(rows: int, width: int, runs: np.ndarray) -> None:
    try:
        check_runs(runs, rows, width)
    except ValueError:
        return
    mask = runs_to_mask(runs, rows, width)
    assert set(np.unique(mask)) <= {0, 1}
    assert np.array_equal(mask_to_runs(mask), runs)
