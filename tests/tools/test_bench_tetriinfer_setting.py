"""bench/tetriinfer_setting.py --quick runs (pure simulation, about a second) and ends with one JSON
line: the SIMULATED disaggregated/coupled ratios first, then the paper's published direction, and
the cost model of OPT-13B on a V100 it was built from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ["LPLD", "LPHD", "HPLD", "HPHD", "Mixed"]
RATIOS = {"ttft_mean", "ttft_p50", "ttft_p90", "jct_mean", "jct_p50", "jct_p90", "perf_per_cost"}


def test_the_tetriinfer_setting_bench_runs_quick_and_reports_simulated_ratios() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tetriinfer_setting.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert list(figures)[:3] == ["simulated_disagg_over_coupled", "label", "paper_direction_published"]
    assert figures["label"].startswith("SIMULATED")
    rows = figures["simulated_disagg_over_coupled"]
    assert list(rows) == [f"{k}|1P+1D v 2C" for k in CLASSES]
    for variants in rows.values():
        assert set(variants) == {"disagg fcfs"}
        assert set(variants["disagg fcfs"]) == RATIOS and all(v > 0 for v in variants["disagg fcfs"].values())
    assert figures["paper_direction_published"]["Mixed"] == {"ttft_mean": 0.15, "jct_mean": 0.5,
                                                             "note": "TTFT -85%, JCT -50%"}
    costs = figures["costs"]
    assert costs["kv_bytes_per_token"] == 2 * 40 * 5120 * 2 and costs["prefill_knee_tokens"] == 512
    assert 0.030 < costs["decode_base_s"] < 0.033  # 25.7 GB of weights streamed at ~825 GB/s
    assert 4000 < costs["kv_tokens"] < 6000  # what 32 GB less 26 GB of weights leaves for KV
    assert figures["setup"]["quick"] is True and figures["simulated_sensitivity"] == {}
    assert "SIMULATED disaggregated / coupled" in run.stdout and "[knee]" in run.stdout
