"""`shardline` subprocesses for benchmarks: started on 127.0.0.1, ready once they print a line."""

from __future__ import annotations

import select
import subprocess
import sys
import threading
import time
from pathlib import Path

SHARDLINE = str(Path(sys.executable).parent / "shardline")


class Proc:
    """`shardline ARGS`, ready once `stream` (stdout or stderr) printed a line starting with
    `prefix` (kept in `.line`). `cpus` pins it with taskset, e.g. "1"."""

    def __init__(self, args: list[str], prefix: str, timeout_s: float = 180.0, cpus: str | None = None,
                 stream: str = "stdout") -> None:
        cmd = (["taskset", "-c", cpus] if cpus else []) + [SHARDLINE, *args]
        pipe = {"stdout": subprocess.PIPE} if stream == "stdout" else {"stderr": subprocess.PIPE}
        quiet = {"stderr": subprocess.DEVNULL} if stream == "stdout" else {"stdout": subprocess.DEVNULL}
        self.proc = subprocess.Popen(cmd, text=True, **pipe, **quiet)  # type: ignore[call-overload]
        out = self.proc.stdout if stream == "stdout" else self.proc.stderr
        assert out is not None
        deadline = time.monotonic() + timeout_s
        self.line = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([out], [], [], 0.5)
            if ready:
                self.line = out.readline()
                if self.line.startswith(prefix):
                    # keep reading, so a chatty process never blocks on a full pipe
                    threading.Thread(target=lambda: [None for _ in out], daemon=True).start()
                    return
        self.stop()
        raise RuntimeError(f"{' '.join(args[:3])}: not ready in {timeout_s:g} s ({self.line.strip()!r})")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak RSS in MB (VmHWM; not ru_maxrss, which exec keeps from the parent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0
