"""`shardline serve`: a pipeline (local stages or workers), the engine, the HTTP app, uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.config import COMPACT_AT, RecoveryConfig, RunConfig, ServeConfig, SpeculationConfig, default_activations
from shardline.errors import ShardlineError
from shardline.host import available_memory, local_addresses, machines
from shardline.model.context import run_context
from shardline.model.manifest import Manifest, load_manifest
from shardline.pipeline.kv import StageLayout
from shardline.pipeline.paged_local import is_paged
from shardline.pipeline.plan import Pipeline, Placed
from shardline.serving.admission import Limits, max_streams_for_memory, paged_prefills, per_stream_bytes
from shardline.serving.drafters import LOOKUP_PRIOR, LookupDrafter
from shardline.serving.engine import Engine, Serving
from shardline.serving.kv_blocks import BlockPool
from shardline.serving.paged_scheduler import PagedScheduler
from shardline.serving.prefix import PrefixCache
from shardline.serving.replay import Replays
from shardline.serving.scheduler import SchedulerConfig
from shardline.serving.speculation import Drafts
from shardline.stage.draft_model import DraftModel
from shardline.wire.tls import Credentials

if TYPE_CHECKING:
    from shardline.disagg.decode import DecodeRole
    from shardline.disagg.front import Disaggregated, FrontConfig
    from shardline.disagg.prefill import Predict, PrefillRole
    from shardline.pipeline.paged_local import PagedPipeline
    from shardline.pipeline.remote import RemotePipeline

log = logging.getLogger("shardline.server")

# The predicted decode length's bucket width (tools/shardline_tools/lengths/length_train.py chose 64 for this model).
DISAGG_G = 64
STREAM_CAP = 64
PAGED_STREAMS = 8  # a paged pool's default: this many streams at the full context (many more at shorter ones)
SHUTDOWN_GRACE_S = 3
# What one open stream costs beyond its KV, per stage (its InferRequest's buffers). Measured
# on the default model, 2 stages, 257 tokens: 14.1 MB per stream of which 11.8 MB is KV
# (BENCHMARKS.md); rounded up.
STREAM_OVERHEAD_BYTES = 2 * 2**20


def stream_limits(manifest: Manifest, cfg: ServeConfig, local_layers: int, context: int, kv: str | None,
                  spec: SpeculationConfig | None = None, draft: Manifest | None = None) -> Limits:
    """As many streams as this node's memory holds at `context` tokens, each with its KV at `kv`
    (None, a device's own: sized as f32)."""
    extra = spec.compact_at + spec.k_max + 1 if spec and spec.kind != "off" else 0
    # the draft's chain (drafts in flight, a guess of the target's token, a next step's drafts:
    # 2 k_max + 1) once in its KV and once more masked, past the COMPACT_AT masked slots it
    # compacts at before each proposal
    draft_extra = COMPACT_AT + 2 * (2 * spec.k_max + 1) if spec and draft else 0
    per_stream = per_stream_bytes(manifest.arch, len(manifest.stages), local_layers, context, kv or "f32", extra,
                                  draft.arch if draft else None, STREAM_OVERHEAD_BYTES, draft_extra)
    fits = max_streams_for_memory(int(available_memory() * cfg.memory_fraction), per_stream, STREAM_CAP)
    return Limits(min(fits, cfg.max_streams or fits), cfg.max_queue)


def model_id(manifest: Manifest, cfg: ServeConfig) -> str:
    return cfg.model_id or Path(manifest.source["path"]).name.removesuffix(".gguf")


def decode_groups(asked: int | None, stages: int, remote: bool) -> int:
    """How many decode groups to batch in: as asked, else what measured fastest (BENCHMARKS.md):
    one per stage when stages have machines (cores) of their own, else one."""
    if asked is not None:
        return asked
    return stages if remote else 1


def open_pipeline(folder: Path, run: RunConfig, workers: list[str] | None = None, activations: str | None = None,
                  topology: str = "chain", credentials: Credentials | None = None,
                  recovery: RecoveryConfig | None = None, summarize: bool = False) -> tuple[Pipeline, int]:
    """The pipeline (stages 1.. here, or on `workers`, over mutual TLS with `credentials`, its
    step deadlines and reconnect window from `recovery`, hidden states on the wire as
    `activations` (None: as the precision implies); prompt summaries for a length predictor if
    `summarize`), and how many layers of it run in this process (for the memory bound)."""
    manifest = load_manifest(folder)
    if workers:
        from shardline.pipeline.deadline import Deadlines
        from shardline.pipeline.remote import RemotePipeline

        rec = recovery or RecoveryConfig()
        wire = activations or default_activations(run.precision)
        pipe = RemotePipeline(folder, workers, run, wire, topology, credentials,
                              deadlines=Deadlines(rec.step_floor_s, rec.step_multiple), reconnect_s=rec.reconnect_s,
                              summarize=summarize, heartbeat_s=rec.heartbeat_s)
        return pipe, manifest.stages[0].last_layer + 1
    from shardline.pipeline.local import LocalPipeline

    return LocalPipeline(folder, run, summarize=summarize), manifest.arch.n_layers


def scheduling(cfg: ServeConfig, manifest: Manifest, remote: bool,
               spec: SpeculationConfig | None = None) -> SchedulerConfig:
    """The scheduler's config from `manifest`'s stages' limits (StageEntry.limits): a stage that
    runs one row at a time (a static one, export/static.py) means no decode groups, and no prompt
    chunk wider than the narrowest stage takes (nor a short prompt whole past it); a cache that
    slides past a ring is no longer whole, so it is never compacted (masked drafts stay)."""
    limits = [e.limits() for e in manifest.stages]
    one_row = any(x.rows == 1 for x in limits)
    groups = 0 if one_row else decode_groups(cfg.decode_groups, len(manifest.stages), remote)
    widths = [x.chunk for x in limits if x.chunk]
    chunk = min([cfg.prefill_chunk, *widths])
    # a short prompt in one call (pacing.py), except where a stage's width binds
    whole = chunk if one_row or cfg.pacing is None else max(chunk, cfg.pacing.short)
    compact_at = 1 << 30 if any(x.slides for x in limits) else (spec or SpeculationConfig()).compact_at
    return SchedulerConfig(chunk=chunk, short_chunk=whole, groups=groups, max_prefills=cfg.max_prefills,
                           compact_at=compact_at, pacing=cfg.pacing)


def open_drafts(spec: SpeculationConfig, target: Manifest, run: RunConfig) -> tuple[Drafts | None, Manifest | None]:
    """Where drafts come from (None: no speculation), and the draft model's manifest if any.
    `layers:L` must have been resolved to its export folder (the CLI exports it on first use)."""
    if spec.kind == "off":
        return None, None
    if spec.kind == "ngram":
        return Drafts(LookupDrafter, spec.k, spec.k_max, LOOKUP_PRIOR), None
    if spec.kind == "layers":
        raise ShardlineError("--draft layers:L must be resolved to its export folder first")
    model = DraftModel(Path(spec.draft), target, run)
    return Drafts(model.drafter, spec.k, spec.k_max), model.manifest


def open_engine(folder: Path, run: RunConfig, cfg: ServeConfig, workers: list[str] | None = None,
                activations: str | None = None, topology: str = "chain", spec: SpeculationConfig | None = None,
                credentials: Credentials | None = None) -> tuple[Engine, Manifest]:
    """Pipeline, scheduler and engine: what `serve` and `generate` both run requests through."""
    manifest = load_manifest(folder)
    if is_paged(manifest):
        engine = open_paged_engine(folder, manifest, run, cfg, workers, spec, activations, topology, credentials)
        return engine, manifest
    spec = spec or SpeculationConfig()
    drafts, draft = open_drafts(spec, manifest, run)
    pipe, local_layers = open_pipeline(folder, run, workers, activations, topology, credentials, cfg.recovery)
    limits = stream_limits(manifest, cfg, local_layers, pipe.context, run.kv, spec, draft)
    replays = Replays(cfg.recovery.max_replays, cfg.recovery.replay_within_s)
    engine = Engine(pipe, limits, pipe.context,
                    scheduling(cfg, manifest, bool(workers), spec), drafts, replays, prefix=prefix_cache(cfg, pipe))
    return engine, manifest


def open_paged_engine(folder: Path, manifest: Manifest, run: RunConfig, cfg: ServeConfig,
                      workers: list[str] | None = None, spec: SpeculationConfig | None = None,
                      activations: str | None = None, topology: str = "chain",
                      credentials: Credentials | None = None) -> Engine:
    """A paged export's engine: every stage here, or stage 0 here and the rest on `workers`
    (each allocating the same pool for this coordinator's session); the block pools sized by
    the memory budget (up to PAGED_STREAMS streams at the full context), streams admitted by
    the blocks they hold."""
    drafts, _ = open_drafts(spec or SpeculationConfig(), manifest, run)
    kv_bytes, streams = paged_pool(cfg)
    pipe = paged_pipeline(folder, run, cfg, kv_bytes, streams, workers, activations, topology, credentials)
    limits = Limits(cfg.max_streams or STREAM_CAP, cfg.max_queue)
    replays = Replays(cfg.recovery.max_replays, cfg.recovery.replay_within_s)
    pool = BlockPool(pipe.blocks, pipe.block_size)
    log.info("paged KV: %d blocks of %d tokens (%.0f MiB over %d stages)", pipe.blocks, pipe.block_size,
             pipe.blocks * pipe.block_bytes / 2**20, len(manifest.stages))
    scheduler = PagedScheduler(paged_scheduling(cfg, manifest, pipe), pool, prefix=cfg.prefix_cache_mb != 0,
                               in_flight=steps_in_flight(workers, len(manifest.stages)), block_bytes=pipe.block_bytes)
    return Engine(pipe, limits, pipe.context, drafts=drafts, replays=replays, scheduler=scheduler)


def steps_in_flight(workers: list[str] | None, stages: int) -> int:
    """Ragged steps a paged engine keeps out at once: one per machine its stages run on (at most
    one per stage). Stages on one machine share its cores: there a second step only contends with
    the first (measured over 2 workers on 2 cores: 4 streams decoded 3.0x faster with one step
    out than with three, BENCHMARKS.md issue 56), and every stream's tokens ride fused in one."""
    return min(stages, machines(workers, local_addresses())) if workers else 1


def paged_scheduling(cfg: ServeConfig, manifest: Manifest, pipe: PagedPipeline | RemotePipeline) -> SchedulerConfig:
    """A paged pool's scheduler config: `scheduling`'s, with no more prompts prefilling at once
    than the pool holds streams at the context (said on stderr when that lowers --max-prefills)."""
    sched = scheduling(cfg, manifest, False)
    prefills, why = paged_prefills(sched.max_prefills, pipe.blocks, pipe.block_size, pipe.context, pipe.block_bytes)
    if why:
        log.warning(why)
    return replace(sched, max_prefills=prefills)


def paged_pipeline(folder: Path, run: RunConfig, cfg: ServeConfig, kv_bytes: int, streams: int | None,
                   workers: list[str] | None, activations: str | None, topology: str,
                   credentials: Credentials | None, summarize: bool = False) -> PagedPipeline | RemotePipeline:
    """A paged export's pipeline: every stage here, or stage 0 here and the rest on `workers`;
    `summarize`: prompt chunks summarized at stage 0 (a prefill instance's, for a length predictor)."""
    if workers:
        from shardline.pipeline.deadline import Deadlines
        from shardline.pipeline.remote import RemotePipeline

        rec = cfg.recovery
        return RemotePipeline(folder, workers, run, activations or default_activations(run.precision), topology,
                              credentials, deadlines=Deadlines(rec.step_floor_s, rec.step_multiple),
                              reconnect_s=rec.reconnect_s, heartbeat_s=rec.heartbeat_s, kv_bytes=kv_bytes,
                              streams=streams, summarize=summarize)
    from shardline.pipeline.paged_local import PagedPipeline

    return PagedPipeline(folder, run, kv_bytes, streams, summarize=summarize)


def paged_pool(cfg: ServeConfig, instances: int = 1) -> tuple[int, int | None]:
    """A paged pool's KV bytes (each of `instances` pipelines'), and the streams at the full
    context it holds at most. The pool is reserved: not all the budget (as the stateful runner's,
    taken as used), a few streams' worth; `--kv-cache-mb` sets it (shared by the instances)."""
    budget = int(available_memory() * cfg.memory_fraction)
    if cfg.kv_cache_mb is not None and cfg.kv_cache_mb << 20 > budget:
        raise ShardlineError(f"--kv-cache-mb {cfg.kv_cache_mb} is more than --memory-fraction of the memory "
                             f"available ({budget >> 20} MiB)")
    if cfg.kv_cache_mb is not None:
        return (cfg.kv_cache_mb << 20) // instances, None
    return budget // instances, PAGED_STREAMS


def prefix_cache(cfg: ServeConfig, pipe: Pipeline, instances: int = 1) -> PrefixCache | None:
    """The prefix cache of an engine (None: off), of `instances` whose pipelines share this
    process (each gets an even share). Its budget holds in every process: an entry is counted
    at the bytes of the process that holds the most of it (this one, with every stage here)."""
    if cfg.prefix_cache_mb == 0:
        return None
    mib = cfg.prefix_cache_mb if cfg.prefix_cache_mb is not None else min(2048, available_memory() // 10 >> 20)
    return PrefixCache((mib << 20) // instances, process_slot_bytes(pipe.layout(), pipe.placement()))


def process_slot_bytes(layout: list[StageLayout], placed: list[Placed]) -> int:
    """The KV bytes of one slot in the process that holds the most: each stage's, summed by where
    it runs (`placed`: runs of stages by their layers)."""
    per: dict[str, int] = {}
    for stage in layout:
        runs = (p.where for p in placed if p.first_layer <= stage.first_layer and stage.last_layer <= p.last_layer)
        where = next(runs, f"layers {stage.first_layer}-{stage.last_layer}")
        per[where] = per.get(where, 0) + stage.slot_bytes
    return max(per.values())


def open_disaggregated(folder: Path, run: RunConfig, cfg: ServeConfig, workers: list[str] | None = None,
                       credentials: Credentials | None = None, activations: str | None = None,
                       front_cfg: FrontConfig | None = None) -> tuple[Disaggregated, Manifest]:
    """`cfg.disaggregate` (P, D): P prefill and D decode instances behind one front end. Each
    instance is a pipeline of every stage: all in this process (threads: as given, else this
    machine's cores shared out), or stage 0 here and the others on a chain of workers of its
    own (the workers given, split evenly in order: instance 0's chain first); KV then moves
    between instances over the workers' links. Decode lengths are predicted as
    `cfg.length_predictor` says (length_prediction). `front_cfg`: the front's own (its monitor
    period, flip thresholds), else the defaults with flips as `cfg.flip` says."""
    from shardline.disagg.decode import decode_instance
    from shardline.disagg.front import Disaggregated, FrontConfig
    from shardline.disagg.instance import Admission, FlipConfig
    from shardline.disagg.policies import PrefillPolicy
    from shardline.disagg.prefill import prefill_instance
    from shardline.disagg.state import HEAVY_DECODE_FROM, Role

    assert cfg.disaggregate is not None
    manifest = load_manifest(folder)
    if is_paged(manifest):
        front = open_paged_disaggregated(folder, manifest, run, cfg, workers, credentials, activations, front_cfg)
        return front, manifest
    n_prefill, n_decode = cfg.disaggregate
    chains = instance_workers(workers, n_prefill + n_decode)
    cores = os.cpu_count() or 1
    run = replace(run, threads=run.threads or max(1, cores // (n_prefill + n_decode)), pinned=False)
    share = replace(cfg, memory_fraction=cfg.memory_fraction / (n_prefill + n_decode))
    local_layers = manifest.stages[0].last_layer + 1 if workers else manifest.arch.n_layers
    context = run_context(manifest.arch, run.context)
    limits = stream_limits(manifest, share, local_layers, context, run.kv)
    replays = Replays(cfg.recovery.max_replays, cfg.recovery.replay_within_s)
    front = Disaggregated(front_cfg or FrontConfig(heavy_from=HEAVY_DECODE_FROM,
                                                   flip=FlipConfig() if cfg.flip else None))
    predict, summarize = length_prediction(cfg.length_predictor, manifest)

    # A prefill instance's chunks fit the stages' limits as a decode instance's do (a static
    # stage's prefill graph takes no wider chunk than it was exported for).
    chunk = scheduling(cfg, manifest, bool(workers)).chunk

    def prefill_on(pipe: Pipeline) -> PrefillRole:
        # every instance has stage 0 here and may flip to prefill: each gets 1/(P+D) of the budget
        return prefill_instance(pipe, limits, context, chunk, front.dispatch, predict,
                                PrefillPolicy(cfg.prefill_policy), replays=replays,
                                chunked_kv=cfg.kv_transfer == "chunk",
                                prefix=prefix_cache(cfg, pipe, n_prefill + n_decode))

    def decode_on(pipe: Pipeline) -> DecodeRole:
        return decode_instance(pipe, limits, context, scheduling(cfg, manifest, bool(workers)),
                               Admission(cfg.admission), limits.max_streams * context, HEAVY_DECODE_FROM,
                               replays=replays)

    def make(role: Role, pipe: Pipeline) -> PrefillRole | DecodeRole:
        return prefill_on(pipe) if role is Role.PREFILL else decode_on(pipe)

    # Every instance's pipeline summarizes prompts when a trained predictor needs it: a decode
    # instance may flip to prefill; its replayed prefills' summaries cost a sum and are not used.
    pipes = [open_pipeline(folder, run, chain, activations, credentials=credentials, recovery=cfg.recovery,
                           summarize=summarize)[0] for chain in chains]
    prefills = {f"instance-{i}": prefill_on(pipes[i]) for i in range(n_prefill)}
    decodes = {f"instance-{i}": decode_on(pipes[i]) for i in range(n_prefill, n_prefill + n_decode)}
    front.start(prefills, decodes, make)
    return front, manifest


def open_paged_disaggregated(folder: Path, manifest: Manifest, run: RunConfig, cfg: ServeConfig,
                             workers: list[str] | None, credentials: Credentials | None = None,
                             activations: str | None = None, front_cfg: FrontConfig | None = None) -> Disaggregated:
    """`cfg.disaggregate` on a paged export: each instance a PagedPipeline in this process with
    its own pool (the KV budget shared out), or stage 0 here and the rest on a chain of workers
    of its own (as open_disaggregated splits them; each worker allocates the instance's pool for
    its session); a stream's blocks moved from a prefill instance's pool into blocks a decode
    instance takes (over the workers' links: KvPull / KvPush of blocks). Decode lengths are
    predicted as `cfg.length_predictor` says (a trained predictor from stage 0's summary of each
    prompt chunk of a ragged step, pipeline/hidden.py). `--kv-transfer chunk` reads a prompt's
    full blocks out as its chunks write them (serving/paged_scheduler.py). With `cfg.flip`, an
    idle instance takes the other role over its pipeline: the new role's scheduler starts from
    an empty pool (the old engine is empty: no block is held; its cached prefixes are forgotten)."""
    from shardline.disagg.decode import decode_instance
    from shardline.disagg.front import Disaggregated, FrontConfig
    from shardline.disagg.instance import Admission, FlipConfig
    from shardline.disagg.policies import PrefillPolicy
    from shardline.disagg.prefill import prefill_instance
    from shardline.disagg.state import HEAVY_DECODE_FROM, Role

    assert cfg.disaggregate is not None
    n_prefill, n_decode = cfg.disaggregate
    instances = n_prefill + n_decode
    run = replace(run, threads=run.threads or max(1, (os.cpu_count() or 1) // instances), pinned=False)
    kv_bytes, streams = paged_pool(cfg, instances)
    predict, summarize = length_prediction(cfg.length_predictor, manifest)
    # Every instance's pipeline summarizes when a trained predictor needs it and roles flip (a
    # decode instance may become a prefill one); else the prefill instances' alone.
    pipes = [paged_pipeline(folder, run, cfg, kv_bytes, streams, chain, activations, "chain", credentials,
                            summarize=summarize and (cfg.flip or i < n_prefill))
             for i, chain in enumerate(instance_workers(workers, instances))]
    limits = Limits(cfg.max_streams or STREAM_CAP, cfg.max_queue)
    replays = Replays(cfg.recovery.max_replays, cfg.recovery.replay_within_s)
    front = Disaggregated(front_cfg or FrontConfig(heavy_from=HEAVY_DECODE_FROM,
                                                   flip=FlipConfig() if cfg.flip else None))
    sched = paged_scheduling(cfg, manifest, pipes[0])  # every instance's pool alike
    prefill_cfg = SchedulerConfig(chunk=sched.chunk, groups=0, max_prefills=1, pacing=None)
    in_flight = steps_in_flight(workers, len(manifest.stages))

    def blocks(pipe: PagedPipeline | RemotePipeline, cfg: SchedulerConfig, prefix: bool) -> PagedScheduler:
        return PagedScheduler(cfg, BlockPool(pipe.blocks, pipe.block_size), prefix=prefix, block_bytes=pipe.block_bytes,
                              in_flight=in_flight)

    def make(role: Role, pipe: PagedPipeline | RemotePipeline) -> PrefillRole | DecodeRole:
        if role is Role.PREFILL:
            return prefill_instance(pipe, limits, pipe.context, sched.chunk, front.dispatch, predict,
                                    PrefillPolicy(cfg.prefill_policy), replays=replays,
                                    chunked_kv=cfg.kv_transfer == "chunk",
                                    paged=blocks(pipe, prefill_cfg, cfg.prefix_cache_mb != 0))
        return decode_instance(pipe, limits, pipe.context, sched, Admission(cfg.admission),
                               limits.max_streams * pipe.context, HEAVY_DECODE_FROM, replays=replays,
                               paged=blocks(pipe, sched, False))

    prefills = {f"instance-{i}": make(Role.PREFILL, pipes[i]) for i in range(n_prefill)}
    decodes = {f"instance-{i}": make(Role.DECODE, pipes[i]) for i in range(n_prefill, instances)}
    front.start(prefills, decodes, make)  # type: ignore[arg-type]  # a paged instance's pipe is paged
    return front


def instance_workers(workers: list[str] | None, instances: int) -> list[list[str] | None]:
    """Each instance's chain of workers: the list split evenly, in order (None: every stage in
    this process). Each chain must then cover stages 1.. (RemotePipeline checks it on connecting)."""
    if not workers:
        return [None] * instances
    if len(workers) % instances:
        raise ShardlineError(f"--disaggregate with --workers: each of the {instances} instances runs stage 0 here "
                             f"and the later stages on a chain of its own; {len(workers)} workers do not split "
                             f"evenly into {instances} chains")
    per = len(workers) // instances
    return [workers[i * per:(i + 1) * per] for i in range(instances)]


def length_prediction(choice: str, manifest: Manifest) -> tuple[Predict, bool]:
    """How prefill instances predict decode lengths (`--length-predictor`), and whether their
    pipelines must summarize prompts for it. "auto" takes the bundled model where it fits the
    export (the default model's default export) and says so; elsewhere each request's
    max_tokens. A model file that is given must fit, or serving does not start."""
    from shardline.disagg.predictor import BUNDLED, LengthPredictor
    from shardline.disagg.prefill import oracle_predict, trained_predict

    by_max = oracle_predict(DISAGG_G, max(2, manifest.arch.max_context // DISAGG_G))
    if choice == "max-tokens":
        return by_max, False
    path = BUNDLED if choice == "auto" else Path(choice)
    try:
        predictor = LengthPredictor.load(path)
        predictor.check_fits(manifest)
    except ShardlineError as e:
        if choice != "auto":
            raise ShardlineError(f"--length-predictor: {e}") from None
        print(f"decode lengths predicted by max_tokens: the bundled length predictor does not fit ({e})",
              file=sys.stderr, flush=True)
        return by_max, False
    print(f"decode lengths predicted by {path.name} (buckets of {predictor.g} tokens)", file=sys.stderr, flush=True)
    return trained_predict(predictor), True


def serve(folder: Path, run: RunConfig, cfg: ServeConfig, workers: list[str] | None = None,
          spec: SpeculationConfig | None = None, credentials: Credentials | None = None,
          activations: str | None = None) -> None:
    import uvicorn

    from shardline.api.app import Served, build_app
    from shardline.model.grammar import Grammars
    from shardline.model.tokenizer import ChatTokenizer

    engine: Serving
    if cfg.disaggregate:
        engine, manifest = open_disaggregated(folder, run, cfg, workers, credentials, activations)
    else:
        engine, manifest = open_engine(folder, run, cfg, workers, activations, spec=spec, credentials=credentials)
    context = run_context(manifest.arch, run.context)
    tok = ChatTokenizer(folder, cfg.chat_template)
    grammars = Grammars((folder / "tokenizer.json").read_text(), manifest.arch.vocab, tok.stop_ids)
    threading.Thread(target=grammars.warm, name="grammar-vocabulary", daemon=True).start()
    served = Served(engine, tok, model_id(manifest, cfg), cfg.default_max_tokens,
                    cfg.max_body_bytes, api_keys=cfg.api_keys, cors_origins=cfg.cors_origins, precision=run.precision,
                    context=context, kv=run.kv or "device default", reconnect_s=cfg.recovery.reconnect_s,
                    grammars=grammars)
    sock = socket.create_server((cfg.host, cfg.port))  # bound here, so port 0 reports its real port
    host, port = sock.getsockname()[:2]
    kinds = "/".join(sorted({e.runner for e in manifest.stages}))  # paged, stateful, static (or a mix)
    print(f"serving {served.model_id} ({len(manifest.stages)} {kinds} stages, context {context} tokens, KV cache "
          f"{served.kv}, up to {engine.limits.max_streams} streams) on http://{host}:{port}/v1",
          file=sys.stderr, flush=True)
    # A stop (Ctrl-C, SIGTERM) waits for open streams at most this long, then ends them.
    server = uvicorn.Server(uvicorn.Config(build_app(served), log_level="warning",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
