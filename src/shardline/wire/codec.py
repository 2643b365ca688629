"""Messages <-> frames: length-prefixed, checksummed, explicit dtype and shape, no pickle.

Frame = header + payload.
  header  "SL" | version u8 | kind u8 | payload length u32 | crc32(payload) u32   (12 bytes, LE)
  payload meta length u32 | meta (UTF-8 JSON of the scalar fields) | arrays, in field order:
          present u8 | dtype u8 | ndim u8 | dims u32 x ndim | raw little-endian bytes

Every field is checked against its declared type both ways (schema.py): a frame that fails, or
whose message's own checks fail, is refused with WireError, and so is anything else that cannot
be decoded; nothing else escapes `decode`. A message of ours that does not fit is not sent.

A timed message (Forward, Sampled) sent with `stamp=True` gets its own encode time written into
the last f64 of its payload (the sender's encode slot of `hops`) before the checksum is taken:
the frame's encode cost travels inside the frame itself.
"""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from typing import Any

import numpy as np

from shardline.wire.messages import MESSAGES, PROTOCOL, Message
from shardline.wire.schema import BY_CLASS, CODES, DTYPES, SCHEMAS, ArrayForm, Schema, dump_meta, load_meta

MAGIC = b"SL"
HEADER = struct.Struct("<2sBBII")
MAX_PAYLOAD = 1 << 30  # a shard chunk or a long prefill fits well below this
# The scalar fields of any message are small (a decode group's sampling is a few KiB): a bigger
# JSON part is refused before parsing, so no frame can make the parser build millions of objects.
MAX_META = 1 << 20
_JSON_OUT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one encoder, not one per call


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


# NaN and Infinity are refused while parsing, wherever they are. A literal that overflows (1e999)
# parses as inf and is refused by the float fields' check: a parse_float hook would cost a Python
# call per number of every frame.
_JSON_IN = json.JSONDecoder(parse_constant=_no_constant)
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_ARRAY_HEAD = struct.Struct("<BBB")  # present, dtype code, ndim; then ndim u32 dims
_DIMS = [struct.Struct(f"<{n}I") for n in range(9)]
# What parsing a peer's payload may raise; each becomes a WireError. RecursionError: deeply nested JSON.
_UNPARSABLE = (ValueError, TypeError, struct.error, RecursionError)


class WireError(Exception):
    """A frame that is not one of ours: truncated, corrupt, unknown, or malformed."""


def encode(msg: Message, stamp: bool = False) -> bytes:
    """The frame of `msg`, or WireError for a field whose value does not fit its declared type
    (our own bug: nothing is sent). With `stamp`, the seconds spent encoding it overwrite the
    last element of its `hops` array (which must be the message's last array field, f64, not
    empty); only the checksum and the header come after the stamp, a few hundred nanoseconds."""
    start = time.perf_counter()
    s = BY_CLASS.get(type(msg))
    if s is None:
        raise WireError(f"{type(msg).__name__} is not a message")
    if stamp:
        _check_stampable(msg, s)
    try:
        meta_bytes = _JSON_OUT.encode(dump_meta(s, msg)).encode()
        parts = [_U32.pack(len(meta_bytes)), meta_bytes]
        for form in s.arrays:
            parts.extend(_encode_array(getattr(msg, form.name), form))
    except ValueError as e:
        raise WireError(f"cannot send {s.cls.__name__}: {e}") from None
    payload = bytearray().join(parts)
    if stamp:
        _F64.pack_into(payload, len(payload) - 8, time.perf_counter() - start)
    return HEADER.pack(MAGIC, PROTOCOL, s.kind, len(payload), zlib.crc32(payload)) + payload


def _check_stampable(msg: Message, s: Schema) -> None:
    hops = getattr(msg, "hops", None)
    if not s.arrays or s.arrays[-1].name != "hops" or not isinstance(hops, np.ndarray) \
            or hops.dtype != np.float64 or hops.size == 0:
        raise WireError(f"{type(msg).__name__} has no f64 hops row to stamp its encode time into")


def _encode_array(a: object, form: ArrayForm) -> list[bytes]:
    if a is None:
        if form.optional:
            return [b"\x00"]
        raise ValueError(f"{form.name} is missing")
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{form.name} is a {type(a).__name__}, not an array")
    code = CODES.get(a.dtype)
    if code is None:  # a big-endian or otherwise foreign dtype: convert, or refuse
        code = CODES.get(a.dtype.newbyteorder("<"))
        if code is None:
            raise ValueError(f"{form.name}: dtype {a.dtype} cannot travel on the wire")
        a = a.astype(DTYPES[code])
    if code not in form.codes or a.ndim != form.ndim:
        raise ValueError(f"{form.name} is {a.dtype.str[1:]} with {a.ndim} dims, not {form.dtypes} with {form.ndim}")
    # tobytes() is C order whatever the array's strides.
    return [_ARRAY_HEAD.pack(1, code, a.ndim), _DIMS[a.ndim].pack(*a.shape), a.tobytes()]


def parse_header(header: bytes) -> tuple[int, int, int]:
    """(kind, payload length, crc) of a 12-byte header, or WireError."""
    if len(header) != HEADER.size:
        raise WireError(f"truncated header: {len(header)} of {HEADER.size} bytes")
    magic, version, kind, length, crc = HEADER.unpack(header)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a shardline peer")
    if version != PROTOCOL:
        raise WireError(f"protocol version {version}, expected {PROTOCOL}")
    if kind not in MESSAGES:
        raise WireError(f"unknown message kind {kind}")
    if length > MAX_PAYLOAD:
        raise WireError(f"frame of {length} bytes exceeds the limit of {MAX_PAYLOAD}")
    return kind, length, crc


def decode(frame: bytes | memoryview) -> Message:
    frame = memoryview(frame)
    kind, length, crc = parse_header(bytes(frame[: HEADER.size]))
    payload = frame[HEADER.size:]
    if len(payload) != length:
        raise WireError(f"truncated frame: payload {len(payload)} of {length} bytes")
    return decode_payload(kind, payload, crc)


def decode_payload(kind: int, payload: bytes | memoryview, crc: int) -> Message:
    """The message of a checked header's payload; WireError, and nothing else, for any bytes."""
    payload = memoryview(payload)
    if zlib.crc32(payload) != crc:
        raise WireError("checksum mismatch: corrupt frame")
    s = SCHEMAS[kind]
    try:
        values = _values(s, payload)
    except _UNPARSABLE as e:
        raise WireError(f"malformed {s.cls.__name__}: {e}") from None
    try:
        msg: Message = s.cls(**values)  # __post_init__: how the fields fit together
    except Exception as e:  # whatever a check raises on a peer's values, the frame is refused
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise WireError(f"malformed {s.cls.__name__}: {why}") from None
    return msg


def _values(s: Schema, payload: memoryview) -> dict[str, Any]:
    """Every field of the payload, each checked against its declared form; ValueError if any is not."""
    (n,) = _U32.unpack_from(payload, 0)
    if n > min(MAX_META, len(payload) - 4):
        raise ValueError(f"fields of {n} bytes in a payload of {len(payload)}")
    meta = _JSON_IN.decode(str(payload[4 : 4 + n], "utf-8"))
    if not isinstance(meta, dict):
        raise ValueError(f"fields are a JSON {type(meta).__name__}, not an object")
    values = load_meta(s, meta)
    pos = 4 + n
    for form in s.arrays:
        values[form.name], pos = _decode_array(payload, pos, form)
    if pos != len(payload):
        raise ValueError(f"{len(payload) - pos} trailing bytes")
    return values


def _decode_array(buf: memoryview, pos: int, form: ArrayForm) -> tuple[np.ndarray | None, int]:
    if pos >= len(buf):
        raise ValueError(f"the payload ends before {form.name}")
    if buf[pos] == 0:
        if not form.optional:
            raise ValueError(f"{form.name} is missing")
        return None, pos + 1
    present, code, ndim = _ARRAY_HEAD.unpack_from(buf, pos)
    if present != 1 or code not in DTYPES or ndim > 8:
        raise ValueError(f"bad array header for {form.name} (present {present}, dtype code {code}, {ndim} dims)")
    dtype = DTYPES[code]
    if code not in form.codes or ndim != form.ndim:
        raise ValueError(f"{form.name} is {dtype.str[1:]} with {ndim} dims, not {form.dtypes} with {form.ndim}")
    shape = _DIMS[ndim].unpack_from(buf, pos + 3)
    pos += 3 + 4 * ndim
    # math.prod, not np.prod: this runs per array per frame and np.prod costs ~8 us a call.
    size = math.prod(shape) * dtype.itemsize
    if pos + size > len(buf):
        raise ValueError(f"{form.name} of shape {shape} runs past the end of the frame")
    return np.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize, offset=pos).reshape(shape), pos + size
