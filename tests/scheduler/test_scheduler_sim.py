"""The policy simulation runs end to end on a short synthetic trace and a recorded one."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SIM_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_sim.py"


def load_sim():
    spec = importlib.util.spec_from_file_location("scheduler_sim", SIM_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scheduler_sim"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_simulation_prints_json_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    assert sim.main(["--duration-s", "8", "--policies", "ema,bucketed,ceiling-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"ema", "bucketed", "ceiling-only"}
    for row in report["policies"].values():
        assert row["requests"] == report["arrivals"] and row["output_tok_per_s"] > 0


def test_simulation_replays_a_recorded_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    trace = tmp_path / "arrivals.jsonl"
    rows = [{"t": 0.0, "prompt_tokens": 9000, "max_tokens": 20}, {"t": 0.1, "prompt_tokens": 50, "max_tokens": 20}]
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    assert sim.main(["--trace", str(trace), "--policies", "ema"]) == 0
    table = capsys.readouterr().out
    assert "| ema |" in table and "2 arrivals" in table
