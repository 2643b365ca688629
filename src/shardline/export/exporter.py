"""`shardline export`: model -> per-stage OpenVINO IRs (stateful, or static: --static) + tokenizer + manifest.

Each stage is built from only its own tensors, optionally in its own process so that its peak
memory is the stage's, not the model's (and is measured). The folder is written under a
temporary name and renamed only once complete, so a folder named like the target is never
a partial export.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import openvino as ov

import shardline
from shardline.config import ExportConfig
from shardline.errors import ShardlineError
from shardline.export.compress import check_group_size, compress
from shardline.export.graph import build_stage, stage_tensor_names
from shardline.export.plan import StageCosts, StagePlan, balanced_split, even_split, fitted_split, parse_layers
from shardline.export.stateful import make_stateful
from shardline.export.static import make_static
from shardline.export.weights import Weights
from shardline.model.arch import Arch
from shardline.model.gguf_blocks import KEPT_TYPES
from shardline.model.gguf_source import cannot_keep, gguf_name
from shardline.model.manifest import MANIFEST, Manifest, PortSpec, StageEntry, hash_files
from shardline.model.paged_ir import cut
from shardline.model.shapes import dynamic
from shardline.model.source import ModelSource, open_source

# The memory a serving stage needs per byte of its shard, after the CPU plugin has made its run-time
# copy and handed the IR's mapped pages back (which the kernel reclaims when memory is short):
# - a matmul's weights: 1.5-1.8x (BENCHMARKS.md, issue 22: the plugin folds the file's small
#   scale factors into an f32 scale and zero point per 32 weights);
# - a mixture's experts and the embedding, whose scales the shard already holds as f32: 1.1x
#   (issue 38: a 4184 MB stage held 4211 MB after load and served under a cgroup cap of 1.064x).
MATMUL_MEMORY_PER_SHARD_BYTE = 1.8
KEPT_MEMORY_PER_SHARD_BYTE = 1.1
# A kept GGUF shard's bytes per byte of its file (issue 38: 1.33-1.34x, Q5/Q6 codes stored as 8-bit).
GGUF_SHARD_PER_FILE_BYTE = 1.34
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}


def plan_for(cfg: ExportConfig, arch: Arch, file_bytes: int = 0) -> list[StagePlan]:
    if cfg.layers is not None:
        return parse_layers(cfg.layers, arch.n_layers)
    assert cfg.stages is not None
    if cfg.memory:
        budgets = cfg.memory * cfg.stages if len(cfg.memory) == 1 else cfg.memory
        return fitted_split(arch.n_layers, [gib * (1 << 30) for gib in budgets],
                            stage_costs(arch, _bytes_per_weight(cfg, arch, file_bytes)))
    if cfg.balance:
        return balanced_split(arch.n_layers, cfg.stages, arch.head_layers)
    return even_split(arch.n_layers, cfg.stages)


def stage_costs(arch: Arch, per_weight: float) -> StageCosts:
    """Work in bytes read per token; sizes in the bytes a serving process needs."""
    table = arch.vocab * arch.hidden * per_weight
    experts = 3 * arch.hidden * arch.expert_ffn * arch.experts  # 0 for a dense model
    matmuls = arch.layer_weights() - experts
    return StageCosts(layer_work=arch.layer_weights(active=True) * per_weight,
                      layer_size=(matmuls * MATMUL_MEMORY_PER_SHARD_BYTE + experts * KEPT_MEMORY_PER_SHARD_BYTE)
                      * per_weight,
                      head_work=table, first_size=table * KEPT_MEMORY_PER_SHARD_BYTE,
                      last_size=table * MATMUL_MEMORY_PER_SHARD_BYTE)


def _bytes_per_weight(cfg: ExportConfig, arch: Arch, file_bytes: int) -> float:
    """A shard's bytes per weight: the file's own average for kept GGUF blocks, else nominal."""
    if cfg.precision == "gguf":
        return file_bytes / arch.weights * GGUF_SHARD_PER_FILE_BYTE
    return BYTES_PER_WEIGHT[cfg.precision]


def export(cfg: ExportConfig) -> Path:
    source = open_source(cfg.model)
    # With --truncate N the exported model is the source's first N layers, then its final norm
    # and head: planning, graphs and the manifest all see an N-layer arch, so no stage reads
    # (and no run time sizes KV for) a layer >= N.
    arch = source.arch if cfg.truncate is None else _truncated(source.arch, cfg.truncate)
    if cfg.sinks is not None and any(arch.window(i) for i in range(arch.n_layers)):
        # Past the ring a sliding cache forgets slots, and positions are no longer the count of
        # attended slots that windowed layers' masks rely on (export/graph.py).
        raise ShardlineError(f"--sinks with a model whose layers have sliding windows "
                             f"({arch.sliding_window} tokens) is not supported: export without --sinks")
    if cfg.static and arch.spec.sinks:
        raise ShardlineError(f"--static: a {arch.family} model's attention sinks are not built for static stages "
                             "(its host-kept cache attends in two parts); export it stateful")
    if cfg.static and cfg.sinks is None:  # no more than the ring: a static stage holds no more
        arch = arch.with_context(cfg.ring)
    elif cfg.context is not None and not cfg.static:
        arch = arch.with_context(cfg.context)
    plans = plan_for(cfg, arch, sum(p.stat().st_size for p in getattr(source, "parts", [])))
    if cfg.precision == "int4":
        check_group_size(arch.hidden, arch.intermediate, cfg.group_size)
    _say_what_happens_to_weights(source, cfg)
    if cfg.precision == "gguf":
        _check_keepable(source, arch, plans)
    out = cfg.out.resolve()
    if out.exists():
        raise ShardlineError(f"output folder already exists: {out} (remove it or choose another --out)")
    tmp = _make_temp(out)
    try:
        source.tokenizer_files(tmp)  # first: cheap, and it fails fast on an incomplete model folder
        entries = _export_stages(cfg, source.path, arch, plans, tmp)
        if cfg.progress and cfg.precision == "gguf":
            how = f"re-blocked into groups of {cfg.reblock}" if cfg.reblock else "kept as the file stores them"
            print(f"{how}: {_kept(entries)}", file=sys.stderr)
        file_sha256 = source.sha256()
        manifest = Manifest(
            source={"path": str(source.path), "format": source.format,
                    "sha256": _model_identity(file_sha256, source.arch, arch, cfg.reblock)},
            arch=arch,
            weights=cfg.precision,
            group_size=cfg.group_size if cfg.precision == "int4" else cfg.reblock,
            stages=entries,
            files=hash_files(tmp),
            versions={"shardline": shardline.__version__, "openvino": ov.get_version(),
                      "python": sys.version.split()[0]},
            extra=_truncation(file_sha256, source.arch, arch) | ({"reblocked": cfg.reblock} if cfg.reblock else {}),
        )
        (tmp / MANIFEST).write_text(manifest.to_json())
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _say_what_happens_to_weights(source: ModelSource, cfg: ExportConfig) -> None:
    """Re-quantizing (or widening) a quantized file is a choice the user makes knowingly."""
    quantized = {k: n for k, n in source.types().items() if k != "F32"}
    if cfg.precision == "gguf" or not quantized or not cfg.progress:
        return
    what = {"int8": "re-quantizing them to int8 through NNCF", "int4": "re-quantizing them to int4 through NNCF",
            "fp16": "storing them as f16", "fp32": "widening them to f32"}[cfg.precision]
    listed = ", ".join(f"{k} ({n})" for k, n in quantized.items())
    print(f"{source.path.name} stores tensors as {listed}: dequantizing them to f32 and {what}; "
          "--weights gguf keeps the file's own", file=sys.stderr)


def _check_keepable(source: ModelSource, arch: Arch, plans: list[StagePlan]) -> None:
    """Every matrix the stages read must be a type --weights gguf keeps: refused before any
    stage is built, never widened to f32 unseen."""
    for plan in plans:
        for name in stage_tensor_names(arch, plan):
            kind = source.stored_type(name)
            if kind not in KEPT_TYPES:
                raise ShardlineError(cannot_keep(source.path.name, gguf_name(name), kind))


def _kept(entries: list[StageEntry]) -> str:
    total: dict[str, int] = {}
    for e in entries:
        for k, n in e.weights_kept.items():
            total[k] = total.get(k, 0) + n
    return ", ".join(f"{k} {n}" for k, n in sorted(total.items())) + " matrices"


def _truncated(full: Arch, n: int) -> Arch:
    if n > full.n_layers:
        raise ShardlineError(f"--truncate {n}: the model has only {full.n_layers} layers")
    return full.truncated(n)


def _model_identity(file_sha256: str, full: Arch, arch: Arch, reblock: int | None = None) -> str:
    """The manifest's model hash. A truncated export is another model (its head reads layer N's
    output), and so is a re-blocked one (other weights): its hash differs from the full model's,
    so that workers holding stages of one are never chained with a coordinator of the other."""
    identity = file_sha256 if arch.n_layers == full.n_layers else f"{file_sha256}:first{arch.n_layers}"
    if reblock:
        identity += f":reblock{reblock}"
    return identity if identity == file_sha256 else hashlib.sha256(identity.encode()).hexdigest()


def _truncation(file_sha256: str, full: Arch, arch: Arch) -> dict[str, object]:
    """What the manifest's `extra` records of a truncation: the source's layer count and hash."""
    if arch.n_layers == full.n_layers:
        return {}
    return {"truncated_from": full.n_layers, "source_sha256": file_sha256}


def _make_temp(out: Path) -> Path:
    if not out.parent.exists():
        raise ShardlineError(f"parent folder of --out does not exist: {out.parent}")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise ShardlineError(f"cannot write to {out.parent}: {e.strerror}") from None
    return tmp


def _export_stages(cfg: ExportConfig, model: Path, arch: Arch, plans: list[StagePlan],
                   tmp: Path) -> list[StageEntry]:
    from tqdm import tqdm

    jobs = [(model, arch, plan, cfg.precision, cfg.group_size, cfg.reblock, tmp,
             (cfg.ring, cfg.prefill_chunk, cfg.sinks) if plan.index in cfg.static else None,
             cfg.paged and plan.index not in cfg.static)  # a static stage beside paged ones (issue 56)
            for plan in plans]
    entries = []
    with tqdm(total=len(plans), desc="export", unit="stage", disable=not cfg.progress, file=sys.stderr) as bar:
        if cfg.isolate:
            # One fresh process per stage: its peak RSS is this stage's alone.
            ctx = get_context("spawn")
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
                for entry in pool.map(_export_one, *zip(*jobs, strict=True)):
                    entries.append(entry)
                    bar.update()
        else:
            for job in jobs:
                entries.append(_export_one(*job))
                bar.update()
    return entries


def _export_one(model: Path, arch: Arch, plan: StagePlan, weights: str, group_size: int, reblock: int | None,
                tmp: Path, static: tuple[int, int | None, int | None] | None = None, paged: bool = False) -> StageEntry:
    """`arch` is the exported model's (the source's, or its first layers with --truncate);
    `static`: (ring, prefill width, sinks) for static graphs (export/static.py); `paged`: a
    paged graph (export/paged.py)."""
    source = open_source(model)
    base = _rss("VmRSS")  # the process before it reads a weight (interpreter, OpenVINO, the header)
    # A static stage is for an NPU, which never runs shardline's ops: it keeps the plugin's form.
    w = Weights(source, weights, reblock, block_ops=static is None)
    graphs = [("", cut(build_stage(arch, plan, w, paged=True)))] if paged else _graphs(arch, plan, w, static)
    saved = [_save(plan.name + suffix, g, weights, group_size, tmp, static is not None) for suffix, g in graphs]
    (xml, graph), prefill = saved[0], saved[1][0] if len(saved) > 1 else None
    entry = StageEntry(
        index=plan.index, first_layer=plan.first, last_layer=plan.last,
        has_embedding=plan.has_embedding, has_head=plan.has_head,
        xml=xml.name, bin=xml.with_suffix(".bin").name,
        inputs=[_port(p) for p in graph.inputs], outputs=[_port(p) for p in graph.outputs],
        state=_state(graph, static is not None, paged),
        export_peak_rss_mb=round(_rss("VmHWM") / 2**20, 1),
        export_base_rss_mb=round(base / 2**20, 1),
        weights_kept=dict(sorted(w.kept.items())),
        weights_bytes=dict(sorted(w.kept_bytes.items())),
        runner="paged" if paged else "stateful" if static is None else "static",
        ring=None if static is None else static[0],
        prefill_xml=prefill.name if prefill else None,
        prefill_bin=prefill.with_suffix(".bin").name if prefill else None,
        prefill_width=static[1] if static is not None else None,
        sinks=static[2] if static is not None else None,
    )
    del graph, source, w, saved
    gc.collect()
    return entry


def _state(graph: ov.Model, static: bool, paged: bool) -> list[str]:
    """What holds the stage's KV: its state variables, a static graph's past inputs, or a paged
    graph's block pools."""
    if paged:
        return sorted(n for p in graph.inputs if (n := p.get_any_name()).startswith(("key_cache.", "value_cache.")))
    if static:
        return sorted(n for p in graph.inputs if (n := p.get_any_name()).startswith("past."))
    return sorted(s.get_variable_id() for s in graph.get_sinks())


def _graphs(arch: Arch, plan: StagePlan, w: Weights,
            static: tuple[int, int | None, int | None] | None) -> list[tuple[str, ov.Model]]:
    """The stage's graphs by file-name suffix: its stateful one, or its static decode graph and
    (with a prefill width) its static prefill graph."""
    if static is None:
        return [("", make_stateful(build_stage(arch, plan, w)))]
    ring, chunk, _ = static
    built = build_stage(arch, plan, w, new_kv_only=True)
    if chunk is None:
        return [("", make_static(built, arch, ring, 1))]
    return [("", make_static(built.clone(), arch, ring, 1)), (".prefill", make_static(built, arch, ring, chunk))]


def _save(name: str, graph: ov.Model, weights: str, group_size: int, tmp: Path,
          static: bool) -> tuple[Path, ov.Model]:
    graph = compress(graph, weights, group_size)
    if static and (left := dynamic(graph)):
        raise ShardlineError(f"{name}: {len(left)} shapes are dynamic after {weights} weight compression, which a "
                             f"static export cannot have: {', '.join(left[:4])}")
    xml = tmp / f"{name}.xml"
    ov.save_model(graph, xml, compress_to_fp16=False)
    return xml, graph


def _port(p: ov.Output) -> PortSpec:
    shape = [d.get_length() if d.is_static else None for d in p.get_partial_shape()]
    return PortSpec(p.get_any_name(), p.get_element_type().get_type_name(), shape)


def _rss(which: str) -> int:
    """This process's resident memory in bytes: VmHWM (its peak) or VmRSS (now). Not ru_maxrss:
    a process started by exec keeps its parent's ru_maxrss, so a stage exported in a spawned
    process would report its parent's peak whenever that was larger."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(which + ":"):
            return int(line.split()[1]) * 1024
    import resource  # not Linux: the best there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
