"""`benchmarks/gpu/bench_graph_reuse.py` runs end to end on the CPU backend and reports every figure it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_graph_reuse_bench_times_each_submission() -> None:
    from benchmarks.gpu.bench_graph_reuse import measure

    result = measure(size=64, count=2, repeats=3)
    submits = [key for key in result if key.startswith("submit_")]
    assert len(submits) == 5 and result["repeats"] == 3
    assert all(result[key] > 0 for key in [*submits, "step_eval_ms"])


def test_the_command_line_prints_one_json_object() -> None:
    command = [sys.executable, "-m", "benchmarks.gpu.bench_graph_reuse", "--size", "32", "--layers", "1", "--repeats", "1"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    assert json.loads(out)["size"] == 32
