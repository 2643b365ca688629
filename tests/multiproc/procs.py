"""`shardline worker` and `shardline relay` processes on loopback whose stderr is kept for the test."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARDLINE = str(Path(sys.executable).parent / "shardline")


class Proc:
    """A shardline subcommand, ready once its first stdout line starts with `ready`; its address
    is the line's word `word`. stderr goes to a file (a pipe nobody reads could fill and block)."""

    def __init__(self, args: list[str], ready: str, word: int = -1) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shardline-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([SHARDLINE, *args], stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(ready), (line, self.stderr())
        self.addr = line.split()[word]

    @property
    def port(self) -> int:
        return int(self.addr.rpartition(":")[2])

    def stderr(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def wait_for_stderr(self, text: str, timeout_s: float = 10.0) -> str:
        """The stderr once it contains `text` (a worker logs from its own threads)."""
        deadline = time.monotonic() + timeout_s
        while text not in (got := self.stderr()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def worker(folder: Path, stage: str, port: int = 0) -> Proc:
    return Proc(["worker", "--shards", str(folder), "--stage", stage, "--listen", f"127.0.0.1:{port}"],
                "listening on ")


def relay(to: str, delay_ms: float) -> Proc:
    """Ready only once bound: `shardline relay` announces itself after binding."""
    return Proc(["relay", "--listen", "127.0.0.1:0", "--to", to, "--delay-ms", str(delay_ms)], "relaying ", 1)
