"""bench/interference.py's own code, small (issue 23: the whole bench runs for many minutes): running
streams, long prompts arriving, the old policy against the new one through the composition root;
one JSON line of figures, and no process left behind. Speed is not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_the_interference_bench_runs_small_and_reports_every_figure() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "interference.py"), "--quick"], capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    for system in ("old_process", "new_process"):
        for case in ("300", "600"):
            for figure in ("max_gap_over_steady", "rate_over_steady", "ttft_over_idle"):
                assert figures[f"{system}_{case}_{figure}"] > 0
    assert set(figures["results"]) == {"old process", "new process"} and figures["api"] is None
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
