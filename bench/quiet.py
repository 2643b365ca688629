"""Wait (bounded) for a quiet machine before measuring: 1-minute load average below a threshold and
no pytest running. Speed figures on this shared 2-core VM mean something only then.

    python bench/quiet.py && python bench/prefill.py     # or call wait_quiet() from a script

Exit status 0 when quiet, 1 when the wait ran out (the caller then says it measured under load).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-load", type=float, default=0.6)
    p.add_argument("--max-wait", type=float, default=1200.0, help="seconds")
    args = p.parse_args()
    quiet, load = wait_quiet(args.max_load, args.max_wait)
    print(f"load {load:.2f}: {'quiet' if quiet else 'NOT quiet'}")
    return 0 if quiet else 1


if __name__ == "__main__":
    sys.exit(main())
