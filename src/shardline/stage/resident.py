"""What a compiled stage keeps in memory: the shard file's pages are released once the plugin has
made its own copy of the weights.

OpenVINO maps a shard's .bin file and the CPU plugin repacks every compressed weight into an
anonymous buffer of its own at the first inference. From then on the mapped original is never
read again (checked: after the release below, prefill chunks and decode steps fault none of it
back), yet its pages stay resident in the process: a worker of an 8B-class stage held its shard
twice, once mapped (RssFile ~ the shard) and once repacked (BENCHMARKS.md, issue 22). So a stage
is warmed up once at load (one token through a scratch request: the repack happens there, not in
a client's first request) while the mapping's pages are handed back to the kernel with
madvise(MADV_PAGEOUT) every quarter second, and once more at the end: the process never holds
both copies whole (a 2 GB stage of an 8B-shaped file peaked at 4.2 GB without this, 2.7 GB
with it). That is advice, never a change of data: a clean file page dropped is read again from the
file if anything touches it, so the worst case of a wrong guess is a slow step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are simply dropped)


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def mapped_ranges(path: Path, maps: str | None = None) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path` (from /proc/self/maps, or `maps`)."""
    target = str(path.resolve())
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def release_file_pages(path: Path) -> int:
    """Advise the kernel to drop this process's resident pages of every mapping of `path`;
    returns the bytes of mapping advised (0 where the platform cannot, or nothing maps it)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    for lo, hi in mapped_ranges(path):
        if madvise(lo, hi - lo, MADV_PAGEOUT) == 0:  # EINVAL on a kernel without it: keep going
            advised += hi - lo
    return advised


@contextmanager
def released_while(path: Path, every_s: float = 0.25) -> Iterator[None]:
    """Release `path`'s pages every `every_s` seconds while the block runs, and once after it."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            release_file_pages(path)

    thread = threading.Thread(target=loop, name="release-pages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        release_file_pages(path)
