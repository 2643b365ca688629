"""Wait (bounded) for a quiet machine before measuring: 1-minute load average below a threshold and
no pytest running. Speed figures on this shared 2-core VM mean something only then.

    python bench/quiet.py && python bench/paged.py       # or call kit.wait_quiet() from a script

Exit status 0 when quiet, 1 when the wait ran out (the caller then says it measured under load).
"""

from __future__ import annotations

import argparse
import sys

from kit import wait_quiet  # bench/ is on sys.path when this script runs


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
