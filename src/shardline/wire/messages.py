"""The closed set of messages that travel between coordinator and stage workers.

Every message is a frozen dataclass with a fixed kind number. Array fields carry explicit dtype
and shape on the wire; everything else is a plain JSON value. Nothing on the wire is code: a
frame whose kind, fields, dtypes or shapes do not match is refused (see codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

PROTOCOL = 3  # 2: Forward and Sampled carry `hops` (per-hop durations); 3: rows (decode groups)

# One row of `hops` per stage a step has run through, appended by the process that ran it:
# durations in seconds on that process's own clock (clocks of different machines never mix).
# Decode, host and encode belong to the process, not the stage: a process that runs several
# stages puts them on its last row (zeros on the others). Host is the time from the incoming
# frame decoded to the outgoing frame's encode started, minus graph time (queueing included).
# Encode is stamped by the codec into the last f64 of the frame (see codec.encode), so a
# sender's own row is always the last one. Stage -1 marks a coordinator relaying (star).
HOP_COLUMNS = ("stage", "graph_s", "decode_s", "host_s", "encode_s")
RELAY = -1


@dataclass(frozen=True)
class Hello:
    """First message on a link, both ways: who I am and what I serve (checked by the peer)."""

    KIND: ClassVar[int] = 1
    protocol: int
    role: str  # "coordinator" | "worker"
    model_hash: str
    first_layer: int  # the layers the sender runs (coordinator: its own stage 0)
    last_layer: int
    weights: str
    activations: str  # "f16" | "f32": dtype of hidden states on this link


@dataclass(frozen=True)
class Refuse:
    """Sent instead of a reply when the peer's request cannot be served; the reason is for people."""

    KIND: ClassVar[int] = 2
    reason: str


@dataclass(frozen=True)
class OpenStream:
    KIND: ClassVar[int] = 3
    stream: int


@dataclass(frozen=True)
class CloseStream:
    KIND: ClassVar[int] = 4
    stream: int


@dataclass(frozen=True)
class Forward:
    """One step, hidden states in: of one stream (one row), or of a decode group (one row per
    stream, see pipeline/groups.py). Prefill and decode differ in `phase`: a prefill carries many
    positions and only its last row is sampled; a decode carries one per row."""

    KIND: ClassVar[int] = 5
    stream: int  # the key the stages' requests are open under: the stream, or the group's key
    seq: int  # step number, echoed in the reply
    phase: str  # "prefill" | "decode"
    rows: list[int]  # the stream of each row
    keep: list[int]  # before the step: the rows of the KV state kept, in order (group.Launch)
    merge: list[int]  # before the step: streams whose own KV is appended after the kept rows
    hidden: np.ndarray  # [rows, T, hidden] f16 or f32
    attention_mask: np.ndarray  # [rows, slots + T] u8 on the wire (0/1), i64 in the graph
    position_ids: np.ndarray  # [rows, T] i64
    sampling: list[dict[str, Any]]  # per row: temperature, top_k, top_p, seed (last stage only)
    want_logits: bool  # return full logits of the last position of every row (e.g. for logprobs)
    hops: np.ndarray  # [stages so far, len(HOP_COLUMNS)] f64; must stay the last array field


@dataclass(frozen=True)
class Sampled:
    """The last stage's answer: per row the chosen token and its log-probability, not logits."""

    KIND: ClassVar[int] = 6
    stream: int
    seq: int
    rows: list[int]
    tokens: list[int]
    logprobs: list[float]
    logits: np.ndarray | None  # [rows, vocab] f32, only when asked for
    hops: np.ndarray  # every stage's row, the last worker's last: see HOP_COLUMNS


@dataclass(frozen=True)
class ShardRequest:
    """A worker asks the coordinator for one file of its shard, during the handshake (before the
    worker's Hello); the answer is ShardChunk frames in order, or a Refuse (see delivery.py)."""

    KIND: ClassVar[int] = 7
    name: str


@dataclass(frozen=True)
class ShardChunk:
    """One piece of a requested file: chunks come in order, offset 0 first, until offset + size
    reaches total (a file of 0 bytes is one empty chunk)."""

    KIND: ClassVar[int] = 8
    name: str
    offset: int
    total: int
    sha256: str  # of the whole file, as in the manifest
    data: np.ndarray  # u8


@dataclass(frozen=True)
class Route:
    """Coordinator -> worker: where this worker's output goes. `next` is the next worker's
    HOST:PORT (a daisy chain); empty means back to the coordinator on this link (the end of the
    chain, or every worker in a star)."""

    KIND: ClassVar[int] = 9
    next: str


Message = Hello | Refuse | OpenStream | CloseStream | Forward | Sampled | ShardRequest | ShardChunk | Route
MESSAGES: dict[int, type] = {m.KIND: m for m in (Hello, Refuse, OpenStream, CloseStream, Forward, Sampled,
                                                 ShardRequest, ShardChunk, Route)}
