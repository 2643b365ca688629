"""The default model's gguf export that the benchmarks share, made once under --work."""

from __future__ import annotations

import sys
from pathlib import Path

from shardline.config import ExportConfig
from shardline.model.manifest import EXPORT_TAG


def shard_folder(work: Path, stages: int, balance: bool = False) -> Path:
    """Named alike by every script, so each reuses the others' exports. The name carries the
    manifest format: an export made by an older shardline is never picked up (it would be refused)."""
    from shardline.export.exporter import export

    folder = work / f"smollm2-135m-gguf-{stages}stages{'-balanced' if balance else ''}-{EXPORT_TAG}"
    if not (folder / "manifest.json").is_file():
        print(f"exporting {folder} ...", file=sys.stderr)
        work.mkdir(parents=True, exist_ok=True)
        export(ExportConfig(out=folder, stages=stages, balance=balance, weights="gguf", isolate=False,
                            progress=False))
    return folder
