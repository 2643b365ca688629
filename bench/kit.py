"""The benchmarks' kit: what every script needs, written once (bench/ is on sys.path when a
script runs, so `from kit import ...`).

- `Proc`: a `shardline` subprocess on 127.0.0.1, ready once it prints its line; `.addr` is the
  HOST:PORT it says it listens on (a worker, a relay, a server), read with `host.parse_hostport`.
- `worker`, `relay`, `relays`: the processes a distributed run needs, started and stopped.
- `shard_folder`: the default model's export under --work, named alike by every script.
- `open_serving`: an engine (or P+D instances) through `server`'s composition root, as `serve`
  builds it, not by hand.
- `wait_quiet`: a bounded wait for a quiet machine before measuring.
- `TEXT`, `text_ids`: a plain English text to cut prompts from.
- `peak_rss_mb`: a process's peak RSS.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardline.config import RunConfig, ServeConfig
    from shardline.model.manifest import Manifest
    from shardline.serving.engine import Serving

# shardline is imported where it is used: bench/regress.py runs this kit against older trees.

SHARDLINE = str(Path(sys.executable).parent / "shardline")

# A plain English text (367 tokens for the default model): prompts of any length are cut from it.
TEXT = (
    "The bicycle is one of the most efficient machines ever built for moving a person from one place to "
    "another. Its basic form has changed surprisingly little since the late nineteenth century, when the "
    "so-called safety bicycle replaced the tall and dangerous high-wheeler. The safety bicycle had two wheels "
    "of equal size, a chain that drove the rear wheel, and a frame shaped like a diamond. Soon afterwards, "
    "air-filled rubber tyres made the ride far more comfortable, and the bicycle quickly became popular "
    "with workers, students and travellers alike.\n\n"
    "Part of the appeal was economic. A bicycle cost much less than a horse, needed no food or stable, and "
    "could be repaired with a few simple tools. In many towns it widened the area in which people could look "
    "for work, and it gave young people, and women in particular, a new kind of independence. Clubs were "
    "founded, roads were improved, and maps were printed especially for cyclists. Some of the engineering "
    "lessons learned in bicycle workshops, such as the use of ball bearings, light steel tubes and careful "
    "wheel building, were later applied to the first motor cars and aeroplanes.\n\n"
    "Today the bicycle is used in very different ways around the world. In some countries it is mainly a "
    "piece of sports equipment, while in others it remains the most common way to get to school, to the "
    "market or to the office. Cities that want to reduce traffic and air pollution often build separate "
    "lanes, parking racks and public rental schemes. Electric bicycles, which add a small motor and a "
    "battery, have made longer distances and steep hills easier for many riders. Even so, the principle is "
    "the same as it was more than a hundred years ago: a rider turns the pedals, the chain turns the wheel, "
    "and a simple frame carries the load with very little wasted energy."
)


def text_ids(folder: Path, n: int) -> list[int]:
    """`n` token ids of TEXT (repeated as needed), by `folder`'s tokenizer."""
    from shardline.model.tokenizer import ChatTokenizer

    ids = ChatTokenizer(folder).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


class Proc:
    """`shardline ARGS`, ready once `stream` (stdout or stderr) printed a line starting with
    `prefix` (kept in `.line`). `cpus` pins it with taskset, e.g. "1"; `exe`: another tree's
    `shardline`; `env`: its whole environment (None: this one's)."""

    def __init__(self, args: list[str], prefix: str, timeout_s: float = 180.0, cpus: str | None = None,
                 stream: str = "stdout", exe: str = SHARDLINE, env: dict[str, str] | None = None) -> None:
        cmd = (["taskset", "-c", cpus] if cpus else []) + [exe, *args]
        pipe = {"stdout": subprocess.PIPE} if stream == "stdout" else {"stderr": subprocess.PIPE}
        quiet = {"stderr": subprocess.DEVNULL} if stream == "stdout" else {"stdout": subprocess.DEVNULL}
        self.proc = subprocess.Popen(cmd, text=True, env=env, **pipe, **quiet)  # type: ignore[call-overload]
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

    @property
    def addr(self) -> str:
        """The HOST:PORT its ready line names: a worker's "listening on H:P", a relay's
        "relaying H:P -> ...", a server's "... http://H:P/v1" (checked, not split by hand)."""
        from shardline.host import parse_hostport

        words = self.line.split()
        word = words[1] if words and words[0] == "relaying" else words[-1]
        word = word.removeprefix("http://").removesuffix("/v1")
        host, port = parse_hostport(word, f"the address in {self.line.strip()!r}")
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        """A server's base URL (…/v1)."""
        return f"http://{self.addr}/v1"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def worker(folder: Path, stage: int, *extra: str, cpus: str | None = None) -> Proc:
    """A worker for `stage` of `folder` (in clear, on loopback) once it listens."""
    return Proc(["worker", "--shards", str(folder), "--stage", str(stage), "--insecure", *extra], "listening on",
                cpus=cpus)


def relay(to: str, delay_ms: float, rate_mbit: float | None = None) -> Proc:
    """A relay in front of `to` (bench: WAN emulation); its `.addr` accepts once it prints."""
    args = ["relay", "--listen", "127.0.0.1:0", "--to", to, "--delay-ms", str(delay_ms)]
    return Proc(args + (["--rate-mbit", str(rate_mbit)] if rate_mbit else []), "relaying")


@contextmanager
def relays(addrs: Sequence[str], delay_ms: float, rate_mbit: float | None = None) -> Iterator[list[str]]:
    """A relay in front of each address, for the run of the block; their addresses in order."""
    procs: list[Proc] = []
    try:
        for a in addrs:
            procs.append(relay(a, delay_ms, rate_mbit))
        yield [p.addr for p in procs]
    finally:
        for p in procs:
            p.stop()


def shard_folder(work: Path, stages: int, weights: str = "gguf", balance: bool = False,
                 model: Path | None = None, paged: bool = False) -> Path:
    """A model's export (default: the embedded one), made once under `work` and named alike by every
    script, so each reuses the others'. The name carries the manifest format (an export of an older
    shardline is never picked up: it would be refused). `weights` "gguf-rbG": the GGUF's blocks
    re-blocked into groups of G (`export --reblock G`); `paged`: paged stages (`export --paged`)."""
    from shardline.config import ExportConfig
    from shardline.export.exporter import export
    from shardline.model.manifest import EXPORT_TAG

    name = "smollm2-135m" if model is None else model.stem
    kind = ("-balanced" if balance else "") + ("-paged" if paged else "")
    folder = work / f"{name}-{weights}-{stages}stages{kind}-{EXPORT_TAG}"
    if not (folder / "manifest.json").is_file():
        print(f"exporting {folder} ...", file=sys.stderr)
        work.mkdir(parents=True, exist_ok=True)
        base, _, group = weights.partition("-rb")
        # (bench/regress.py: older trees know no reblock)
        extra: dict[str, Any] = {"reblock": int(group)} if group else {}
        if model is not None:
            extra["model"] = model
        if paged:
            extra["paged"] = True
        export(ExportConfig(out=folder, stages=stages, balance=balance, weights=base, isolate=False, progress=False,
                            **extra))
    return folder


def open_serving(folder: Path, run: RunConfig | None = None, serve: ServeConfig | None = None,
                 workers: Sequence[str] | None = None, **options: Any) -> tuple[Serving, Manifest]:
    """What `shardline serve` serves through, built by its composition root (server.py): one
    engine, or with `serve.disaggregate` P prefill and D decode instances behind a front.
    `options`: open_engine's (activations, topology, spec, credentials)."""
    from shardline.config import RunConfig, ServeConfig
    from shardline.server import open_disaggregated, open_engine

    run, serve = run or RunConfig(), serve or ServeConfig()
    addrs = list(workers) if workers else None
    if serve.disaggregate:
        return open_disaggregated(folder, run, serve, addrs, **options)
    return open_engine(folder, run, serve, addrs, **options)


def pytest_running() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0


def wait_quiet(max_load: float = 0.6, max_wait_s: float = 1200.0, poll_s: float = 30.0) -> tuple[bool, float]:
    """Poll every `poll_s` until the load average is below `max_load` and no pytest runs, for at
    most `max_wait_s`. Returns (quiet, load average at the end)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = os.getloadavg()[0]
        busy = pytest_running()
        if load < max_load and not busy:
            return True, load
        if time.monotonic() + poll_s > deadline:
            print(f"quiet: gave up waiting (load {load:.2f}{', pytest running' if busy else ''})", file=sys.stderr)
            return False, load
        print(f"quiet: waiting (load {load:.2f}{', pytest running' if busy else ''})", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak RSS in MB (VmHWM; not ru_maxrss, which exec keeps from the parent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0
