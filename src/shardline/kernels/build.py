"""Building the kernels' library against the installed `openvino` wheel (its cmake/ folder
holds OpenVINOConfig.cmake and TBB's config), with cmake and g++.

The library lands in `_build/<digest>/` beside these sources, the digest over the sources and the
OpenVINO version: a change to either builds anew, and a library is used only by the sources it
was built from. Written to a temporary folder and renamed, so a build cut short leaves nothing
that looks built.

    python -m shardline.kernels.build            the extension (the install runs it)
    python -m shardline.kernels.build --check    and the kernel check, under AddressSanitizer
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import openvino as ov

HERE = Path(__file__).parent
LIBRARY = "libshardline_kernels.so"


def digest() -> str:
    h = hashlib.blake2b(ov.__version__.encode(), digest_size=8)
    for p in sorted([HERE / "CMakeLists.txt", *(HERE / "src").iterdir(), *(HERE / "check").iterdir()]):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def library() -> Path:
    """Where this source's library is (or would be) built."""
    return HERE / "_build" / digest() / LIBRARY


def _cmake(source: Path, out: Path, *flags: str) -> None:
    cmake_dir = Path(ov.__file__).parent / "cmake"
    configure = ["cmake", "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DOpenVINO_DIR={cmake_dir}", f"-DTBB_DIR={cmake_dir}", *flags]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for cmd in (configure, ["cmake", "--build", str(out), "-j", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n" + "\n".join(tail))


def build() -> Path:
    """The extension built (if not already) for these sources; RuntimeError saying why not."""
    target = library()
    if target.is_file():
        return target
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed")
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent.parent) as tmp:
        _cmake(HERE, Path(tmp) / "cmake", "-DSHARDLINE_EXTENSION=ON")
        staged = Path(tmp) / "out"
        staged.mkdir()
        shutil.copy2(Path(tmp) / "cmake" / LIBRARY, staged / LIBRARY)
        try:
            staged.rename(target.parent)
        except OSError:  # built meanwhile by another process: theirs is the same
            if not target.is_file():
                raise
    for old in target.parent.parent.iterdir():  # earlier sources' builds
        if old != target.parent and not old.name.startswith("tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return target


def build_check(out: Path, sanitize: bool = True) -> Path:
    """The kernel check program (check/kernel_check.cpp), under ASan and UBSan by default."""
    # Optimized (Release, as shipped): the sanitizers check the code that runs, in a fraction of
    # a debug build's time.
    _cmake(HERE, out, f"-DSHARDLINE_SANITIZE={'ON' if sanitize else 'OFF'}", "-DSHARDLINE_EXTENSION=OFF")
    return out / "kernel_check"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardline.kernels.build", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="also build and run the kernel check under ASan")
    args = ap.parse_args(argv)
    try:
        print(f"kernels: {build()}")
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                return subprocess.run([str(build_check(Path(tmp)))]).returncode
    except (RuntimeError, OSError) as e:
        # The install goes on without them: stages keep the plugin's matmuls and say so once.
        print(f"kernels: not built ({e}); stages will use OpenVINO's own matmuls", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
