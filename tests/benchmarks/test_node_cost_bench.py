"""`benchmarks/gpu/bench_node_cost.py` runs end to end on the CPU backend (its CUDA-only kinds left out) and reports
a host and a step time a node for every kind it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_reports_its_cost_a_node() -> None:
    from benchmarks.gpu.bench_node_cost import measure

    result = measure(width=64, nodes=3, repeats=2, on_cuda=False)
    kinds = {"matmul_rows1", "matmul_rows8", "matmul_rows1024", "elementwise", "view"}
    assert kinds <= result.keys() and "custom" not in result
    for kind in kinds:
        assert result[kind]["host_us_a_node"] > 0
        assert result[kind]["step_us_a_node"] >= result[kind]["host_us_a_node"]


def test_the_chained_step_keeps_each_kinds_shape() -> None:
    import mlx.core as mx

    from benchmarks.gpu.bench_node_cost import kinds

    for name, (rows, step) in kinds(64, on_cuda=False).items():
        x = mx.zeros((rows, 64), dtype=mx.bfloat16)
        assert step(step(x)).shape == (rows, 64), name


def test_the_command_line_prints_one_json_object() -> None:
    command = [sys.executable, "-m", "benchmarks.gpu.bench_node_cost", "--width", "32", "--nodes", "2", "--repeats", "1"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    assert json.loads(out)["width"] == 32
