"""The sessions a worker serves (one per coordinator's chain) and what its readers queue for
its executor. Pure: no sockets are opened here.

A reader may queue at most MAX_QUEUED items of one link that the executor has not handled yet:
past that it waits (TCP then holds the peer back), so no peer can make the worker keep an
unbounded queue. Steps that arrive before their session's Route are held apart, at most
MAX_QUEUED of them; a session that sends more is dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from shardline.node.kv import Push
from shardline.stage.paged_runner import Pool
from shardline.wire.link import Link
from shardline.wire.messages import PROTOCOL, Hello, Message, Role

MAX_QUEUED = 256  # per link; far more than a coordinator has in flight (a step per stream)


@dataclass(eq=False)
class Session:
    """One coordinator's chain through this worker."""

    id: str
    no: int  # the first part of every key this session holds on the stages
    coordinator: Link
    next: Link | None = None  # the next worker (daisy chain); None: replies go to the coordinator
    routed: bool = False  # its Route has been applied
    held: list[Received] = field(default_factory=list)  # Forwards that came before the Route
    push: Push | None = None  # a KV push whose parts are still arriving
    pools: list[Pool] | None = None  # a paged worker's: this session's KV blocks on each stage


@dataclass(frozen=True)
class Received:
    link: Link
    session: Session
    msg: Message
    decode_s: float
    decoded_at: float
    slot: threading.Semaphore | None = None  # the reader's: released once the executor has it


@dataclass(frozen=True)
class Routed:
    session: Session
    next: Link | None


@dataclass(frozen=True)
class Ended:
    session: Session


Item = Received | Routed | Ended


def check_peer(me: Hello, peer: Hello, sessions: dict[str, Session]) -> str | None:
    """Why `peer` may not join this worker (None when it may): the same model, weights and
    protocol, layers that end right before ours, and a session that is new for a coordinator
    or already here for the previous worker of a chain."""
    if peer.protocol != PROTOCOL:
        return f"protocol {peer.protocol}, this worker speaks {PROTOCOL}"
    if peer.model_hash != me.model_hash:
        return (f"model hash mismatch: worker (layers {me.first_layer}-{me.last_layer}) has "
                f"{me.model_hash[:12]}, {peer.role} has {peer.model_hash[:12]}")
    if peer.weights != me.weights:
        return f"precision mismatch: worker has {me.weights} weights, {peer.role} has {peer.weights}"
    if peer.context != me.context:
        return (f"context mismatch: worker serves {me.context} tokens, {peer.role} {peer.context} "
                f"(give them the same --context)")
    if peer.block_size != me.block_size:
        return (f"KV layout mismatch: the {peer.role}'s stages are "
                + (f"paged in blocks of {peer.block_size} tokens" if peer.block_size else "not paged")
                + ", this worker's " + (f"paged in blocks of {me.block_size}" if me.block_size else "are not paged"))
    if peer.last_layer + 1 != me.first_layer:
        return (f"layer order: the {peer.role}'s chain ends at layer {peer.last_layer}, "
                f"but this worker serves layers {me.first_layer}-{me.last_layer}")
    if len(peer.session) != 32:
        return "a session id of 32 hex digits is required"
    if peer.role == Role.COORDINATOR and peer.session in sessions:
        return f"session {peer.session[:8]} is already connected"
    if peer.role == Role.WORKER and peer.session not in sessions:
        return f"no coordinator of session {peer.session[:8]} is connected here"
    return None
