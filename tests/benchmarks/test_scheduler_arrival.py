"""The arrival benchmark runs and measures both cases (its numbers live in RESULTS.md, not here)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_arrival_benchmark_reports_each_length_cached_and_not():
    out = subprocess.run([sys.executable, "benchmarks/scheduler_arrival.py", "--lengths", "600,2000", "--repeats", "1",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    rows = json.loads(out.stdout)
    assert [(r["prompt_tokens"], r["cached_prefix"]) for r in rows] == [(600, False), (600, True), (2000, False),
                                                                          (2000, True)]  # fmt: skip
    assert all(r["arrival_ms_p50"] > 0 for r in rows)
