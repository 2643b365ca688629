"""The embedded default model's shards: where they are cached, and exported on first use.

Folder names carry the manifest format, so an export made by an older shardline is never
picked up by a newer one (it would be refused at load); the new one is exported beside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shardline.config import ExportConfig
from shardline.model.manifest import EXPORT_TAG, MANIFEST, load_manifest

DEFAULT_STAGES = 2
DEFAULT_WEIGHTS = "gguf"
DEFAULT_PREFIX = "smollm2-135m-"


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))


def default_shards(progress: bool = True, paged: bool = True) -> Path:
    """The default model in DEFAULT_STAGES balanced stages, exported once and cached: paged
    stages (what serving runs by default, issue 41), or stateful ones (`paged=False`: the
    paper's path, and what the serve options a paged export does not take need)."""
    kind = "balanced-paged" if paged else "balanced"
    folder = cache_dir() / f"{DEFAULT_PREFIX}{DEFAULT_WEIGHTS}-{DEFAULT_STAGES}stages-{kind}-{EXPORT_TAG}"
    what = "the default model's paged shards" if paged else "the default model's shards"
    return _cached(folder, what, ExportConfig(
        out=folder, stages=DEFAULT_STAGES, balance=True, weights=DEFAULT_WEIGHTS, progress=progress, paged=paged))


def planned_folder(spec: str) -> Path:
    return cache_dir() / f"{DEFAULT_PREFIX}{DEFAULT_WEIGHTS}-layers-{spec.replace(',', '_')}-{EXPORT_TAG}"


def planned_shards(spec: str) -> Path:
    """The default model exported with one stage per range of a placement plan, cached per plan."""
    folder = planned_folder(spec)
    return _cached(folder, "the default model's shards for this plan",
                   ExportConfig(out=folder, layers=spec, weights=DEFAULT_WEIGHTS))


def self_draft_shards(layers: int, progress: bool = True) -> Path:
    """The default model's first `layers` decoder layers, then its final norm and head, as one
    stage (a self-speculation draft for the default model), exported once and cached."""
    folder = cache_dir() / f"{DEFAULT_PREFIX}{DEFAULT_WEIGHTS}-first{layers}-{EXPORT_TAG}"
    return _cached(folder, f"the default model's shards (first {layers} layers)", ExportConfig(
        out=folder, stages=1, weights=DEFAULT_WEIGHTS, truncate=layers, progress=progress))


def self_draft_for(target: Path, layers: int, progress: bool = True) -> Path:
    """A self-speculation draft for the export `target`: its source model's first `layers`
    layers with the same weights, one stage of the target's kind (paged beside a paged target),
    exported once and cached by source, weights and kind."""
    from shardline.errors import ShardlineError

    m = load_manifest(target)
    if not 1 <= layers < m.arch.n_layers:
        raise ShardlineError(f"--draft layers:{layers}: the target has {m.arch.n_layers} layers; "
                             f"a draft keeps 1 to {m.arch.n_layers - 1}")
    source = Path(m.source["path"])
    if not source.exists():
        raise ShardlineError(f"--draft layers:{layers}: the target's source model {source} is not on this machine")
    paged = any(e.runner == "paged" for e in m.stages)
    kind = "-paged" if paged else ""
    folder = cache_dir() / f"self-{m.model_hash[:16]}-{m.weights}-first{layers}{kind}-{EXPORT_TAG}"
    return _cached(folder, f"a self-speculation draft (the first {layers} layers of {source.name})", ExportConfig(
        out=folder, model=source, stages=1, weights=m.weights, group_size=m.group_size or 64, truncate=layers,
        progress=progress, paged=paged))


def default_model_layers() -> int:
    """The default model's layer count: from a cached export of it when there is one, since
    reading the GGUF takes seconds (and without a cached export, an export follows anyway)."""
    from shardline.model.source import open_source

    for manifest in sorted(cache_dir().glob(f"{DEFAULT_PREFIX}*-{EXPORT_TAG}/{MANIFEST}")):
        m = load_manifest(manifest.parent)
        return int(m.extra.get("truncated_from", m.arch.n_layers))  # a self draft keeps fewer
    return open_source(None).arch.n_layers


def _cached(folder: Path, what: str, cfg: ExportConfig) -> Path:
    from shardline.export.exporter import export

    if not (folder / MANIFEST).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        print(f"preparing {what} in {folder} (first run only)", file=sys.stderr)
        export(cfg)
    return folder
