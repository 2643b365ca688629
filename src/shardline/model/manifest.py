"""What a shard folder is: ranges, names, shapes, precision, checksums, versions.

The manifest is the contract between export and run time: a runner trusts nothing in the
folder that the manifest does not name and hash.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardline.errors import ShardlineError
from shardline.model.arch import Arch
from shardline.model.source import file_sha256

MANIFEST = "manifest.json"
# 2: the last stage takes logits_index (logits only where tokens are chosen); 3: architectures
# by family (biases, rope factors and scaling, sliding window), what each stage kept of a GGUF;
# 4: static stages (a runner kind, a ring, a prefill graph). A format-3 manifest still loads:
# its stages are all stateful.
FORMAT_VERSION = 4
READS = (3, 4)
# How the graphs are built, inside the same format: an older export still loads and runs, only
# slower. 3: RoPE in the form OpenVINO fuses, and with it the KV cache inside the attention node;
# 4: q, k and v (and gate and up) as one matmul each; 5: block-quantized matmuls and the embedding
# as the file's own bytes under shardline's ops (kernels/).
GRAPH_REVISION = 5
EXPORT_TAG = f"f{FORMAT_VERSION}g{GRAPH_REVISION}"  # in cached exports' folder names


@dataclass(frozen=True)
class PortSpec:
    name: str
    dtype: str
    shape: list[int | None]  # None = dynamic


@dataclass(frozen=True)
class StageLimits:
    """What one stage takes in a call: every engine's scheduler config is built from its
    stages' limits (server.scheduling), whatever the engine's role."""

    rows: int | None = None  # streams per call (None: any: decode groups may batch them)
    chunk: int | None = None  # prompt tokens per call (None: any)
    ring: int | None = None  # KV slots a stream may hold (None: the context)
    slides: bool = False  # past the ring the oldest slots slide (sinks kept): a cache never compacted
    ragged: bool = False  # one flat batch of every stream's tokens over block tables (paged)


@dataclass(frozen=True)
class StageEntry:
    index: int
    first_layer: int
    last_layer: int
    has_embedding: bool
    has_head: bool
    xml: str
    bin: str
    inputs: list[PortSpec]
    outputs: list[PortSpec]
    state: list[str]
    export_peak_rss_mb: float | None = None
    export_base_rss_mb: float | None = None  # the export process before it read a weight
    # Under --weights gguf: the file's types the stage's matrices were kept in, and their bytes.
    weights_kept: dict[str, int] = field(default_factory=dict)
    weights_bytes: dict[str, int] = field(default_factory=dict)
    # What runs the stage (stage/runners.py): "stateful", its KV cache in the compiled model's
    # state, or "static" (export/static.py: every shape fixed, the KV on the host in a ring of
    # `ring` slots; `xml` takes one new token, `prefill_xml`, if any, `prefill_width` at once).
    # A manifest without the key was made before runner kinds existed: stateful.
    runner: str = "stateful"
    ring: int | None = None
    prefill_xml: str | None = None
    prefill_bin: str | None = None
    prefill_width: int | None = None
    sinks: int | None = None  # past the ring: these first slots stay, the rest slide (None: refused)

    def limits(self) -> StageLimits:
        """What its runner takes in one call, as the export declared it (stage/runners.py)."""
        if self.runner == "static":
            return StageLimits(rows=1, chunk=self.prefill_width, ring=self.ring, slides=bool(self.sinks))
        return StageLimits(ragged=self.runner == "paged")

    @property
    def files(self) -> list[str]:
        """The files this stage runs from (its graphs and their weights)."""
        return [f for f in (self.xml, self.bin, self.prefill_xml, self.prefill_bin) if f]

    @property
    def name(self) -> str:
        return f"stage{self.index}"


@dataclass(frozen=True)
class Manifest:
    source: dict[str, str]  # path, format, sha256
    arch: Arch
    weights: str
    group_size: int | None
    stages: list[StageEntry]
    files: dict[str, str]  # relative path -> sha256 (every file but the manifest itself)
    versions: dict[str, str]
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_hash(self) -> str:
        return self.source["sha256"]

    def to_json(self) -> str:
        d = asdict(self)
        d["arch"] = self.arch.to_dict()
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format_version") not in READS:
            raise ShardlineError(f"manifest format {d.get('format_version')} is not one of "
                                 f"{', '.join(map(str, READS))} (made by another shardline?)")
        stages = []
        for s in d["stages"]:
            ins = [PortSpec(**p) for p in s.pop("inputs")]
            outs = [PortSpec(**p) for p in s.pop("outputs")]
            stages.append(StageEntry(inputs=ins, outputs=outs, **s))
        return cls(
            source=d["source"], arch=Arch.from_dict(d["arch"]), weights=d["weights"],
            group_size=d.get("group_size"), stages=stages, files=d["files"], versions=d["versions"],
            format_version=d["format_version"], extra=d.get("extra", {}),
        )


def load_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ShardlineError(f"shard folder does not exist: {folder}")
    if not path.is_file():
        raise ShardlineError(f"{folder} is not a shardline export: {MANIFEST} is missing")
    try:
        return Manifest.from_dict(json.loads(path.read_text()))
    except ShardlineError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ShardlineError(f"corrupt manifest {path}: {type(e).__name__}: {e}") from None


def hash_files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): file_sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify(folder: Path, manifest: Manifest, only: list[str] | None = None) -> None:
    """Raise on the first missing or altered file (restricted to `only` when given)."""
    for rel, digest in manifest.files.items():
        if only is not None and rel not in only:
            continue
        p = folder / rel
        if not p.is_file():
            raise ShardlineError(f"{folder}: file {rel} named in the manifest is missing")
        if file_sha256(p) != digest:
            raise ShardlineError(f"{folder}: checksum mismatch for {rel} (corrupt or modified)")
