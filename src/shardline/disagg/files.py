"""The files disaggregation reads and writes (costs, the length predictor, its dataset): written
all or nothing, read bounded in size, with one clear error for a file that cannot be read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardline.errors import ShardlineError


def write_text_atomic(path: Path, text: str) -> None:
    """All or nothing: a reader never sees a half-written file (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path, what: str, max_bytes: int) -> Any:
    """`path`'s JSON value, refusing a file past `max_bytes` before reading it; any failure is
    one ShardlineError naming `what` (e.g. "costs file") and the path."""
    try:
        if path.stat().st_size > max_bytes:
            raise ShardlineError(f"{what} {path}: larger than {max_bytes} bytes")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise ShardlineError(f"cannot read the {what} {path}: {type(e).__name__}: {e}") from None
