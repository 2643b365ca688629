"""`shardline worker`, `relay` and `serve` processes on loopback whose stderr is kept for the test."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

SHARDLINE = str(Path(sys.executable).parent / "shardline")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Sets SIGINT and SIGTERM to SIG_DFL, or to SIG_IGN for the signals listed in argv[1], then execs
# argv[2:]: an ignored signal stays ignored across exec (how a shell's background job starts with
# SIGINT ignored), and a test process started that way must not pass it on unasked. subprocess
# restores only SIGPIPE, SIGXFZ and SIGXFSZ, and preexec_fn is unsafe once the test has threads.
_EXEC_WITH_DISPOSITIONS = """
import os, signal, sys
ignored = {int(s) for s in sys.argv[1].split(",") if s}
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
os.execv(sys.argv[2], sys.argv[2:])
"""


def with_dispositions(command: list[str], ignore: Iterable[signal.Signals] = ()) -> list[str]:
    """`command`, started with SIGINT and SIGTERM at their defaults except those in `ignore`."""
    return [sys.executable, "-c", _EXEC_WITH_DISPOSITIONS, ",".join(str(int(s)) for s in ignore), *command]


# Sets RLIMIT_NOFILE (soft and hard) to argv[1], then execs argv[2:]: the same pid, with at most
# that many file descriptors open (no preexec_fn: unsafe once the test has threads).
_EXEC_WITH_NOFILE = """
import os, resource, sys
n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
os.execv(sys.argv[2], sys.argv[2:])
"""


def with_nofile(command: list[str], nofile: int) -> list[str]:
    """`command`, allowed at most `nofile` open file descriptors."""
    return [sys.executable, "-c", _EXEC_WITH_NOFILE, str(nofile), *command]


class Proc:
    """A shardline subcommand, ready once a line of its stdout (or stderr, for `serve`) starts with
    `ready`; its address is that line's word `word`. stderr goes to a file (a pipe nobody reads
    could fill and block). Signals in `ignore` start ignored; SIGINT and SIGTERM otherwise start at
    their defaults, whatever the test process inherited. `nofile`: its limit of open file
    descriptors (the pid stays the command's own). Stopped (killed) on leaving a `with`."""

    def __init__(self, args: list[str], ready: str, word: int = -1, *, ignore: Iterable[signal.Signals] = (),
                 ready_on_stderr: bool = False, env: Mapping[str, str] | None = None,
                 timeout_s: float = 120.0, nofile: int | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shardline-", suffix=".log")  # noqa: SIM115
        command = [SHARDLINE, *args] if nofile is None else with_nofile([SHARDLINE, *args], nofile)
        self.proc = subprocess.Popen(with_dispositions(command, ignore), env=env, text=True,
                                     stdout=subprocess.DEVNULL if ready_on_stderr else subprocess.PIPE,
                                     stderr=self.log)
        try:
            line = self._ready_line(ready, ready_on_stderr, timeout_s)
            assert line.startswith(ready), (line, self.stderr())
        except BaseException:
            self.stop()  # a process that never got ready is not left behind
            raise
        self.addr = line.split()[word]

    def _ready_line(self, ready: str, on_stderr: bool, timeout_s: float) -> str:
        if not on_stderr:
            assert self.proc.stdout is not None
            # Readable means a line (the commands print whole lines, flushed) or EOF (it died).
            readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            return self.proc.stdout.readline() if readable else ""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            for line in self.stderr().splitlines():
                if line.startswith(ready):
                    return line
            time.sleep(0.05)
        return self.stderr()

    @property
    def port(self) -> int:
        """The port of `HOST:PORT` or of `http://HOST:PORT/PATH`."""
        return int(self.addr.rpartition(":")[2].partition("/")[0])

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
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def worker(folder: Path, stage: str, port: int = 0, ignore: Iterable[signal.Signals] = (),
           nofile: int | None = None, credentials: Path | None = None, extra: Iterable[str] = ()) -> Proc:
    """`shardline worker` (more flags in `extra`): over mutual TLS with `credentials`, else in
    clear (--insecure)."""
    security = ["--credentials", str(credentials)] if credentials else ["--insecure"]
    return Proc(["worker", "--shards", str(folder), "--stage", stage, "--listen", f"127.0.0.1:{port}", *security,
                 *extra], "listening on ", ignore=ignore, nofile=nofile)


@contextmanager
def workers_of(folder: Path, *stages: str) -> Iterator[list[Proc]]:
    """A `shardline worker` for each of `stages` of `folder`, stopped when the block ends (those
    already started too, if a later one fails to start)."""
    procs: list[Proc] = []
    try:
        for stage in stages:
            procs.append(worker(folder, stage))
        yield procs
    finally:
        for p in procs:
            p.stop()


def relay(to: str, delay_ms: float, ignore: Iterable[signal.Signals] = ()) -> Proc:
    """Ready only once bound: `shardline relay` announces itself after binding."""
    return Proc(["relay", "--listen", "127.0.0.1:0", "--to", to, "--delay-ms", str(delay_ms)], "relaying ", 1,
                ignore=ignore)


def serve(args: list[str], ignore: Iterable[signal.Signals] = (), env: Mapping[str, str] | None = None) -> Proc:
    """`shardline serve ARGS`, ready once bound: it then reports `serving ... on http://HOST:PORT/v1`
    on stderr (its address is that URL)."""
    return Proc(["serve", *args], "serving ", ignore=ignore, ready_on_stderr=True,
                env=None if env is None else {**os.environ, **env})
