"""What a worker serves: stages K-L of an export, verified in its folder or delivered by the first
coordinator that connects (node/delivery.py), then compiled; and the Hello it answers with."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from shardline.config import RunConfig
from shardline.errors import ShardlineError
from shardline.model.context import run_context
from shardline.model.manifest import Manifest, load_manifest, verify
from shardline.node.delivery import CHUNK, DeliveryError, fetch, stage_files
from shardline.stage.paged_runner import PagedRunner
from shardline.stage.runners import Stage, open_stage
from shardline.wire.link import Link, chunk_payload, refuse
from shardline.wire.messages import PROTOCOL, Activations, Hello, Role

log = logging.getLogger("shardline.worker")


def parse_stage_range(spec: str, n_stages: int | None) -> tuple[int, int]:
    """K or K-L; checked against the export's stage count when known (a worker that waits for its
    shard learns it from the delivered manifest, and refuses a range the model does not have)."""
    lo, _, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ShardlineError(f"bad --stage {spec!r} (expected K or K-L)") from None
    if not 1 <= first <= last < (n_stages if n_stages is not None else last + 1):
        bound = f"1-{n_stages - 1}" if n_stages is not None else "1 and up"
        raise ShardlineError(f"--stage {spec!r}: workers host stages {bound} (stage 0 is the coordinator's)")
    return first, last


def stage_count(folder: Path) -> int | None:
    """Stages of the export in `folder`, or None when it has no readable manifest (yet)."""
    try:
        return len(load_manifest(folder).stages)
    except ShardlineError:
        return None


class Shard:
    def __init__(self, folder: Path, first: int, last: int, run: RunConfig, fetch: bool) -> None:
        """Stages first-last of the export in `folder`. Without `fetch` the folder must hold them,
        verified now (else ShardlineError); with `fetch` whatever is missing or corrupt is received
        from the first coordinator that connects (the folder may be empty or absent)."""
        self.folder, self.first, self.last, self.run = folder, first, last, run
        self.stages: list[Stage] = []
        self.paged: list[PagedRunner] = []  # or, for a paged export (issue 41), these (pools per session)
        self.is_last = False
        self.vocab = 0  # the model's, once loaded: what a step's token masks must cover
        self.indices: list[int] = []  # the stages' indices in the export
        self.hello: Hello | None = None  # set once the stages are loaded: the worker is ready
        self.received_bytes = 0  # shard bytes delivered by a coordinator since this start
        self._loading = threading.Lock()
        if (manifest := self._cached(fetch)) is not None:
            self._load(manifest)

    def _cached(self, fetch: bool) -> Manifest | None:
        """The manifest when the folder holds these stages, verified; else None (to fetch)."""
        try:
            manifest = load_manifest(self.folder)
            verify(self.folder, manifest, only=stage_files(manifest, self.first, self.last))
            return manifest
        except (ShardlineError, DeliveryError) as e:
            if not fetch:
                raise ShardlineError(str(e)) from None
            log.info("%s; waiting for a coordinator to deliver stages %d-%d", e, self.first, self.last)
            return None

    def _load(self, manifest: Manifest) -> None:
        entries = manifest.stages[self.first : self.last + 1]
        context = run_context(manifest.arch, self.run.context)
        runs = [self.run.for_stage(k, len(entries)) for k in range(len(entries))]
        kinds = {e.runner for e in manifest.stages}
        if "paged" in kinds and len(kinds) > 1:
            raise ShardlineError(f"{self.folder}: the export mixes paged stages with other kinds")
        if "paged" in kinds:  # each session gets its pools when it joins (node/paged.py)
            self.paged = [PagedRunner.load(self.folder, e, r, 1, vocab=manifest.arch.vocab, context=context)
                          for e, r in zip(entries, runs, strict=True)]
            if len({s.block_size for s in self.paged}) > 1:
                raise ShardlineError("this worker's devices chose different KV block sizes")
        else:
            self.stages = [open_stage(self.folder, e, r, vocab=manifest.arch.vocab, context=context)
                           for e, r in zip(entries, runs, strict=True)]
        self.is_last = entries[-1].has_head
        self.vocab = manifest.arch.vocab
        self.indices = [e.index for e in entries]
        devices = ",".join(r.device for r in runs)
        self.hello = Hello(PROTOCOL, Role.WORKER, manifest.model_hash, entries[0].first_layer,
                           entries[-1].last_layer, manifest.weights, Activations.ANY, "", context, devices,
                           self.paged[0].block_size if self.paged else 0)

    def ready_for(self, link: Link, peer: Hello) -> Hello:
        """This worker's Hello for `peer`, fetching and loading the shard first if need be."""
        with self._loading:  # one delivery at a time; later connections find the stages loaded
            if self.hello is None:
                if peer.role != Role.COORDINATOR:
                    raise refuse(link, f"the worker for stages {self.first}-{self.last} has no shard yet: "
                                       f"only a coordinator can deliver it")
                link.max_payload = chunk_payload(CHUNK)  # shard chunks are bigger than handshake frames
                manifest, self.received_bytes = fetch(link, self.folder, peer, self.first, self.last)
                try:
                    self._load(manifest)
                except ShardlineError as e:
                    raise refuse(link, str(e)) from None
                log.info("stages %d-%d loaded from %s (%d bytes delivered)", self.first, self.last,
                         self.folder, self.received_bytes)
            assert self.hello is not None
            return self.hello
