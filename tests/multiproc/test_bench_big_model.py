"""bench/big_model.py's own code on a tiny file of the same layout (issue 22: the 8B-class bench is
too slow for CI, so CI runs the same code small): a GGUF in Q4_K_M's mix with rope_freqs, its
1- and 4-stage exports, a 4-process TLS chain of real workers, decode groups, verify steps;
one JSON line of figures, and no process left behind. Speed is not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_the_big_model_bench_runs_small_and_reports_every_figure(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "big_model.py"), "--quick", "--no-llama-cpp",
                          "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    variants = ("exact", "fast", "fast_reblocked")
    firsts = [f"{k}_{v}" if k.startswith(("streams4", "verify5", "worker_rss")) else k.replace("{v}", v)
              for v in variants for k in ("one_stage_{v}_over_llama_cpp", "four_over_one_stage_{v}",
                                          "four_{v}_over_llama_rpc", "streams4_over_1", "verify5_over_1",
                                          "worker_rss_over_model", "one_stage_{v}_over_bound")]
    assert list(figures)[:len(firsts)] == firsts
    assert figures["one_stage_fast_over_llama_cpp"] is None and figures["quick"] is True
    names = ("exact", "fast", "fast re-blocked")
    runs = {f"shardline {n} {p}" for n in ("1 stage", "4 processes") for p in names}
    assert set(figures["tok_s"]) == runs and all(v > 0 for v in figures["tok_s"].values())
    assert set(figures["worker_peak_rss_mb"]) == {f"shardline 4 processes {p}" for p in names}
    assert all(len(r) == 3 and min(r) > 0 for r in figures["worker_peak_rss_mb"].values())
    assert {k: len(v) for k, v in figures["exports"].items()} == {"1": 1, "4": 4, "1_rb": 1, "4_rb": 4}
    assert all(set(v) == {"1", "2", "3", "4"} for v in figures["verify_over_one"].values())
    assert all(set(v) == {"1", "2"} for v in figures["aggregate_tok_s"].values())
    assert "shardline 4 processes fast re-blocked" in run.stdout and "verify step / one-token step" in run.stdout
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
