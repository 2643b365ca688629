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
import functools
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
_ARRAY_FIELDS: dict[type, list[str]] = {}


class WireError(Exception):
    """A frame that is not one of ours: truncated, corrupt, unknown, or malformed."""


def _array_fields(cls: type) -> list[str]:
    if cls not in _ARRAY_FIELDS:
        hints = get_type_hints(cls)
        _ARRAY_FIELDS[cls] = [f.name for f in dataclasses.fields(cls) if "ndarray" in str(hints[f.name])]
    return _ARRAY_FIELDS[cls]


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def encode(msg: Message, stamp: bool = False) -> bytes:
    """The frame of `msg`. With `stamp`, the seconds spent encoding it overwrite the last element
    of its `hops` array (which must be the message's last array field, f64, not empty); only the
    checksum and the header come after the stamp, a few hundred nanoseconds for a decode step."""
    start = time.perf_counter()
    cls = type(msg)
    arrays = _array_fields(cls)
    if stamp:
        _check_stampable(msg, arrays)
    meta = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in arrays}
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    parts = [struct.pack("<I", len(meta_bytes)), meta_bytes]
    for name in arrays:
        parts.extend(_encode_array(getattr(msg, name)))
    payload = bytearray().join(parts)
    if stamp:
        struct.pack_into("<d", payload, len(payload) - 8, time.perf_counter() - start)
    return HEADER.pack(MAGIC, PROTOCOL, cls.KIND, len(payload), zlib.crc32(payload)) + payload


def _check_stampable(msg: Message, arrays: list[str]) -> None:
    hops = getattr(msg, "hops", None)
    if not arrays or arrays[-1] != "hops" or not isinstance(hops, np.ndarray) or hops.dtype != np.float64 \
            or hops.size == 0:
        raise WireError(f"{type(msg).__name__} has no f64 hops row to stamp its encode time into")


def _encode_array(a: np.ndarray | None) -> list[bytes]:
    if a is None:
        return [b"\x00"]
    a = np.ascontiguousarray(a)
    code = _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if code is None:
        raise WireError(f"dtype {a.dtype} cannot travel on the wire")
    return [struct.pack(f"<BBB{a.ndim}I", 1, code, a.ndim, *a.shape), a.astype(_DTYPES[code], copy=False).tobytes()]


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
    try:
        (n,) = struct.unpack_from("<I", payload, 0)
        meta = json.loads(bytes(payload[4 : 4 + n]))
        pos = 4 + n
        values: dict[str, Any] = dict(meta)
        for name in _array_fields(cls):
            values[name], pos = _decode_array(payload, pos)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"malformed {cls.__name__}: {e}") from None
    if pos != len(payload):
        raise WireError(f"malformed {cls.__name__}: {len(payload) - pos} trailing bytes")
    if not isinstance(meta, dict) or values.keys() != _field_names(cls):
        raise WireError(f"malformed {cls.__name__}: fields {sorted(values)} != {sorted(_field_names(cls))}")
    msg: Message = cls(**values)
    return msg


def _decode_array(buf: memoryview, pos: int) -> tuple[np.ndarray | None, int]:
    present = buf[pos]
    if present == 0:
        return None, pos + 1
    code, ndim = buf[pos + 1], buf[pos + 2]
    if code not in _DTYPES or ndim > 8:
        raise ValueError(f"bad array header (dtype code {code}, {ndim} dims)")
    shape = struct.unpack_from(f"<{ndim}I", buf, pos + 3)
    pos += 3 + 4 * ndim
    dtype = _DTYPES[code]
    # math.prod, not np.prod: this runs per array per frame and np.prod costs ~8 us a call.
    size = math.prod(shape) * dtype.itemsize
    if pos + size > len(buf):
        raise ValueError(f"array of shape {shape} runs past the end of the frame")
    return np.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize, offset=pos).reshape(shape), pos + size
