"""Messages <-> frames: length-prefixed, checksummed, explicit dtype and shape, no pickle.

Frame = header + payload.
  header  "SL" | version u8 | kind u8 | payload length u32 | crc32(payload) u32   (12 bytes, LE)
  payload meta length u32 | meta (UTF-8 JSON of the scalar fields) | arrays, in field order:
          present u8 | dtype u8 | ndim u8 | dims u32 x ndim | raw little-endian bytes

A timed message (Forward, Sampled) sent with `stamp=True` gets its own encode time written into
the last f64 of its payload (the sender's encode slot of `hops`) before the checksum is taken:
the frame's encode cost travels inside the frame itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time
import zlib
from typing import Any, get_type_hints

import numpy as np

from shardline.wire.messages import MESSAGES, PROTOCOL, Message

MAGIC = b"SL"
HEADER = struct.Struct("<2sBBII")
MAX_PAYLOAD = 1 << 30  # a shard chunk or a long prefill fits well below this
_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("<i8"), 4: np.dtype("<i4"), 5: np.dtype("u1"),
    6: np.dtype("<f8"),
}
_CODES = {v: k for k, v in _DTYPES.items()}
_JSON_OUT = json.JSONEncoder(separators=(",", ":"))  # one encoder, not one per call (json.dumps)
_JSON_IN = json.JSONDecoder()
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_ARRAY_HEAD = struct.Struct("<BBB")  # present, dtype code, ndim; then ndim u32 dims
_DIMS = [struct.Struct(f"<{n}I") for n in range(9)]


class WireError(Exception):
    """A frame that is not one of ours: truncated, corrupt, unknown, or malformed."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A message class's fields split once: JSON scalars, then arrays in field order."""

    meta: tuple[str, ...]
    arrays: tuple[str, ...]
    names: frozenset[str]


_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    if cls not in _LAYOUTS:
        hints = get_type_hints(cls)
        fields = [f.name for f in dataclasses.fields(cls)]
        arrays = tuple(f for f in fields if "ndarray" in str(hints[f]))
        _LAYOUTS[cls] = _Layout(tuple(f for f in fields if f not in arrays), arrays, frozenset(fields))
    return _LAYOUTS[cls]


def encode(msg: Message, stamp: bool = False) -> bytes:
    """The frame of `msg`. With `stamp`, the seconds spent encoding it overwrite the last element
    of its `hops` array (which must be the message's last array field, f64, not empty); only the
    checksum and the header come after the stamp, a few hundred nanoseconds for a decode step."""
    start = time.perf_counter()
    cls = type(msg)
    layout = _layout(cls)
    if stamp:
        _check_stampable(msg, layout.arrays)
    meta_bytes = _JSON_OUT.encode({name: getattr(msg, name) for name in layout.meta}).encode()
    parts = [_U32.pack(len(meta_bytes)), meta_bytes]
    for name in layout.arrays:
        parts.extend(_encode_array(getattr(msg, name)))
    payload = bytearray().join(parts)
    if stamp:
        _F64.pack_into(payload, len(payload) - 8, time.perf_counter() - start)
    return HEADER.pack(MAGIC, PROTOCOL, cls.KIND, len(payload), zlib.crc32(payload)) + payload


def _check_stampable(msg: Message, arrays: tuple[str, ...]) -> None:
    hops = getattr(msg, "hops", None)
    if not arrays or arrays[-1] != "hops" or not isinstance(hops, np.ndarray) or hops.dtype != np.float64 \
            or hops.size == 0:
        raise WireError(f"{type(msg).__name__} has no f64 hops row to stamp its encode time into")


def _encode_array(a: np.ndarray | None) -> list[bytes]:
    if a is None:
        return [b"\x00"]
    code = _CODES.get(a.dtype)
    if code is None:  # a big-endian or otherwise foreign dtype: convert, or refuse
        code = _CODES.get(a.dtype.newbyteorder("<"))
        if code is None:
            raise WireError(f"dtype {a.dtype} cannot travel on the wire")
        a = a.astype(_DTYPES[code])
    if a.ndim > 8:
        raise WireError(f"{a.ndim} dimensions cannot travel on the wire (at most 8)")
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
    payload = memoryview(payload)
    if zlib.crc32(payload) != crc:
        raise WireError("checksum mismatch: corrupt frame")
    cls = MESSAGES[kind]
    layout = _layout(cls)
    try:
        (n,) = _U32.unpack_from(payload, 0)
        meta = _JSON_IN.decode(str(payload[4 : 4 + n], "utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"fields are a JSON {type(meta).__name__}, not an object")
        pos = 4 + n
        values: dict[str, Any] = meta
        for name in layout.arrays:
            values[name], pos = _decode_array(payload, pos)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"malformed {cls.__name__}: {e}") from None
    if pos != len(payload):
        raise WireError(f"malformed {cls.__name__}: {len(payload) - pos} trailing bytes")
    if values.keys() != layout.names:
        raise WireError(f"malformed {cls.__name__}: fields {sorted(values)} != {sorted(layout.names)}")
    msg: Message = cls(**values)
    return msg


def _decode_array(buf: memoryview, pos: int) -> tuple[np.ndarray | None, int]:
    present = buf[pos]
    if present == 0:
        return None, pos + 1
    code, ndim = buf[pos + 1], buf[pos + 2]
    if code not in _DTYPES or ndim > 8:
        raise ValueError(f"bad array header (dtype code {code}, {ndim} dims)")
    shape = _DIMS[ndim].unpack_from(buf, pos + 3)
    pos += 3 + 4 * ndim
    dtype = _DTYPES[code]
    # math.prod, not np.prod: this runs per array per frame and np.prod costs ~8 us a call.
    size = math.prod(shape) * dtype.itemsize
    if pos + size > len(buf):
        raise ValueError(f"array of shape {shape} runs past the end of the frame")
    return np.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize, offset=pos).reshape(shape), pos + size
