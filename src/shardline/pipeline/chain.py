"""The coordinator's links to its workers: one session, checked hop by hop, routed.

Each link starts with a handshake in which the coordinator speaks for the chain up to the layer
before that worker (its Hello carries the session id, picked anew for every connect); the
worker's answer must carry the same model hash and weights and continue the layers. A worker
without its shard asks for its files first and gets them from this coordinator's export folder
(node/delivery.py). Once every link is up, each worker is told where its output goes (Route).
"""

from __future__ import annotations

import secrets
import ssl
from collections.abc import Callable
from pathlib import Path

from shardline.errors import ShardlineError
from shardline.host import parse_hostport
from shardline.model.manifest import Manifest
from shardline.node import delivery
from shardline.wire.codec import WireError
from shardline.wire.link import Link, LinkClosed, Refused, client_handshake, refuse
from shardline.wire.messages import PROTOCOL, Activations, Hello, Message, Role, Route, ShardRequest
from shardline.wire.tls import Credentials

HANDSHAKE_S = 600.0  # how long a worker may take to answer (delivery, verification, compilation)

Delivered = list[tuple[str, str, int]]  # (worker, file, bytes) sent to workers


def open_chain(folder: Path, manifest: Manifest, workers: list[str], activations: str, topology: str,
               delivered: Delivered, credentials: Credentials | None, context: int,
               reaching: Callable[[int], None] = lambda i: None, pool: tuple[int, int] = (0, 0)) -> list[Link]:
    """One link per worker, in chain order, under a new session; routed for `topology`; under
    mutual TLS with `credentials` (None: in clear); every worker serving `context` tokens.
    `reaching(i)` is told before worker i is connected (who a stuck attempt waits on). `pool`:
    a paged chain's (block size, blocks), which every worker allocates for the session."""
    session = secrets.token_hex(16)
    links: list[Link] = []
    last = manifest.stages[0].last_layer
    try:
        for i, addr in enumerate(workers):
            reaching(i)
            link, hello = _connect_one(folder, manifest, addr, last, session, activations, delivered, credentials,
                                       context, pool)
            links.append(link)
            last = hello.last_layer
        if last != manifest.arch.n_layers - 1:
            raise ShardlineError(f"the workers end at layer {last}; the model has {manifest.arch.n_layers} layers")
        for i, link in enumerate(links):
            chained = topology == "chain" and i + 1 < len(links)
            link.send(Route(workers[i + 1] if chained else ""))
    except (ShardlineError, LinkClosed) as e:
        for link in links:
            link.close()
        raise ShardlineError(str(e)) from None
    return links


def _connect_one(folder: Path, m: Manifest, addr: str, prev_last: int, session: str, activations: str,
                 delivered: Delivered, credentials: Credentials | None, context: int,
                 pool: tuple[int, int]) -> tuple[Link, Hello]:
    try:
        # A worker may hash its files, receive its shard and compile its stages before it
        # answers our Hello: give it minutes, not the default seconds.
        link = Link.connect(*parse_hostport(addr, "worker"), credentials, handshake_timeout=HANDSHAKE_S)
    except ssl.SSLError as e:
        raise ShardlineError(f"worker {addr} refused this node's credentials or showed none: {e}") from None
    except (OSError, ValueError) as e:  # ValueError: a host name the resolver cannot encode ("..")
        raise ShardlineError(f"cannot reach worker {addr}: {e}") from None
    mine = Hello(PROTOCOL, Role.COORDINATOR, m.model_hash, 0, prev_last, m.weights, Activations(activations), session,
                 context, block_size=pool[0], blocks=pool[1])

    def check(peer: Hello) -> str | None:
        if peer.model_hash != m.model_hash:
            return (f"model hash mismatch: coordinator has {m.model_hash[:12]}, "
                    f"worker {addr} has {peer.model_hash[:12]}")
        if peer.first_layer != prev_last + 1:
            return (f"worker {addr} serves layers {peer.first_layer}-{peer.last_layer}, "
                    f"but the chain needs layer {prev_last + 1} next")
        if peer.weights != m.weights:
            return f"precision mismatch: coordinator has {m.weights} weights, worker {addr} has {peer.weights}"
        if peer.context != context:
            return (f"context mismatch: coordinator serves {context} tokens, worker {addr} {peer.context} "
                    f"(give them the same --context)")
        if peer.block_size != pool[0]:
            return f"KV layout mismatch: worker {addr}'s blocks are of {peer.block_size} tokens, ours of {pool[0]}"
        return None

    def deliver(msg: Message) -> None:
        """A worker without its shard asks for a file before its Hello: send it, or refuse."""
        try:
            sent = delivery.serve(link, folder, m, msg)
        except delivery.DeliveryError as e:
            raise refuse(link, str(e)) from None
        assert isinstance(msg, ShardRequest)
        delivered.append((addr, msg.name, sent))

    try:
        return link, client_handshake(link, mine, check, deliver)
    except (Refused, LinkClosed, WireError) as e:
        link.close()
        raise ShardlineError(f"worker {addr}: {e}") from None
