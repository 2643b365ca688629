"""A worker's part of a KV move: a key's state out of its stages (pull), into them (push), or
copied from one key into another on each of them (copy: prefix reuse), over its coordinator's
link, in the order of that link (pipeline/remote_kv.py is the other end).

Everything here answers with a KvDone rather than raise: an unknown key, a part that does not
fit this worker's stages (layers, name, dtype, shape), a key already open. A push changes nothing
until its last part is in and every one fits; then it opens the key on each stage and, if a
stage refuses, closes it again on the stages it opened (a key that was open before is never
touched). Keys are scoped by the session, as every step's are.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from shardline.errors import StepRefused
from shardline.model.manifest import StageEntry
from shardline.stage.runners import Stage, copy_kv
from shardline.wire.messages import KvCopy, KvDone, KvPart, KvPull, KvPush, Message

States = dict[str, tuple[np.dtype[Any], int, int]]  # name -> (dtype, kv_heads, head_dim)
WIRE = (np.dtype("<f4"), np.dtype("<f2"))  # what a KvPart may carry (messages.KvPart)


class Layered(Protocol):
    """What a push's parts are checked against: a stage's layers and KV variables (a Stage, or a
    paged worker's stage: node/paged.py)."""

    @property
    def entry(self) -> StageEntry: ...
    def kv_layout(self) -> States: ...


def states(stage: Layered) -> States:
    """The stage's KV variables (made once per stage: Stage.kv_layout)."""
    return stage.kv_layout()


@dataclass(eq=False)
class Push:
    """A push whose parts are arriving: each checked as it comes, kept per stage until the last."""

    msg: KvPush
    got: int = 0
    arrays: list[dict[str, np.ndarray]] = field(default_factory=list)  # per stage of this worker
    error: str = ""  # the first part that did not fit: the rest are only counted


def pull(stages: list[Stage], key: Hashable, msg: KvPull) -> Iterator[Message]:
    """A KvPart per state variable of every stage, then a KvDone; only a KvDone when some stage
    does not hold the key."""
    if missing := [s.entry.name for s in stages if not s.has(key)]:
        yield KvDone(msg.seq, 0, f"unknown key {msg.key} on {', '.join(missing)}")
        return
    sent = 0
    for stage in stages:
        try:
            arrays = sorted(stage.kv(key, msg.start).items())
        except Exception as e:  # noqa: BLE001 - the coordinator hears why, the worker goes on
            yield KvDone(msg.seq, sent, f"{stage.entry.name}: {type(e).__name__}: {e}")
            return
        for name, state in arrays:
            if state.dtype not in WIRE or state.ndim != 4 or state.shape[0] < 1:
                yield KvDone(msg.seq, sent, f"{stage.entry.name} state {name} is {state.dtype} "
                                            f"{list(state.shape)}: it cannot travel")
                return
            yield KvPart(msg.seq, stage.entry.first_layer, stage.entry.last_layer, name, state)
            sent += 1
    yield KvDone(msg.seq, sent, "")


def begin(stages: Sequence[Layered], msg: KvPush, refused: str | None = None) -> Push:
    """A push under way; `refused` (node/bounds.py) makes it keep none of its parts."""
    push = Push(msg, arrays=[{} for _ in stages])
    if refused:
        push.error = refused
    elif msg.parts < (want := sum(len(states(s)) for s in stages)):
        push.error = f"{msg.parts} parts announced; this worker's stages hold {want} state variables"
    return push


def add(stages: Sequence[Layered], push: Push, part: KvPart) -> None:
    """Keep `part` if it fits one of `stages`; a part of layers no stage here runs is skipped (a
    coordinator that cannot tell which worker runs which stages sends each of them all)."""
    push.got += 1
    if push.error:
        return
    for stage, kept in zip(stages, push.arrays, strict=True):
        e = stage.entry
        if (part.first_layer, part.last_layer) == (e.first_layer, e.last_layer):
            push.error = _misfit(stage, push.msg, part, kept)
            if not push.error:
                kept[part.name] = part.state
            return
        if part.first_layer <= e.last_layer and e.first_layer <= part.last_layer:
            push.error = (f"a part of layers {part.first_layer}-{part.last_layer} for {e.name}, "
                          f"which runs layers {e.first_layer}-{e.last_layer}")
            return


def _misfit(stage: Layered, push: KvPush, part: KvPart, kept: dict[str, np.ndarray]) -> str:
    """Why `part` does not fit `stage` ("" when it does)."""
    spec = states(stage).get(part.name)
    if spec is None:
        return f"{stage.entry.name} has no state {part.name}"
    if part.name in kept:
        return f"state {part.name} of {stage.entry.name} twice"
    dtype, heads, dim = spec
    want = (push.rows, heads, push.slots, dim)
    if part.state.dtype != dtype or part.state.shape != want:
        return (f"{stage.entry.name} state {part.name} is {part.state.dtype} {list(part.state.shape)}; "
                f"expected {dtype} {list(want)}")
    return ""


def finish(stages: list[Stage], key: Hashable, push: Push) -> KvDone:
    """Open `key` with the pushed state on every stage, or on none (the answer says why)."""
    msg = push.msg
    if not push.error:
        push.error = incomplete(stages, push)
    if push.error:
        return KvDone(msg.seq, push.got, f"key {msg.key}: {push.error}")
    opened: list[Stage] = []
    try:
        for stage, arrays in zip(stages, push.arrays, strict=True):
            stage.open(key)  # refuses a key already open: it is neither overwritten nor closed below
            opened.append(stage)
            stage.set_kv(key, arrays)
    except Exception as e:  # noqa: BLE001 - nothing stays half open; the coordinator hears why
        for stage in opened:
            stage.close(key)
        why = str(e) if isinstance(e, StepRefused) else f"key {msg.key}: {type(e).__name__}: {e}"
        return KvDone(msg.seq, push.got, why)
    return KvDone(msg.seq, push.got, "")


def incomplete(stages: Sequence[Layered], push: Push) -> str:
    for stage, arrays in zip(stages, push.arrays, strict=True):
        if missing := sorted(states(stage).keys() - arrays.keys()):
            return f"{stage.entry.name} lacks state {', '.join(missing[:4])}"
    return ""


def copy(stages: list[Stage], scope: object, msg: KvCopy) -> KvDone:
    """Open the key `msg.dst` on every stage with its slots of `msg.src`, or on none (the
    answer says why). Keys are the session's: (scope, key)."""
    src, dst = (scope, msg.src), (scope, msg.dst)
    if missing := [s.entry.name for s in stages if not s.has(src)]:
        return KvDone(msg.seq, 0, f"unknown key {msg.src} on {', '.join(missing)}")
    opened: list[Stage] = []
    try:
        for stage in stages:
            copy_kv(stage, src, dst, msg.row, msg.index)
            opened.append(stage)
    except Exception as e:  # noqa: BLE001 - nothing stays half open; the coordinator hears why
        for stage in opened:
            stage.close(dst)
        why = str(e) if isinstance(e, StepRefused) else f"{type(e).__name__}: {e}"
        return KvDone(msg.seq, 0, f"copy of key {msg.src} into {msg.dst}: {why}")
    return KvDone(msg.seq, 0, "")
