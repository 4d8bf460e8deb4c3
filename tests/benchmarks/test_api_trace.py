"""`benchmarks/gpu/api_trace.py` and its CUPTI shim off the device: calls land in the engine thread's range that
holds them, the shim builds and loads against the CUPTI it finds, and without a driver the script says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.api_calls import ApiCall, ApiCalls, cupti_dirs
from benchmarks.gpu.api_trace import Span, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_calls_count_in_the_range_of_their_thread_that_holds_them() -> None:
    spans = [Span("submit", 3, 1.000, 1.010, 7), Span("collect", 2, 1.010, 1.020, 7), Span("submit", 4, 1.020, 1.040, 7)]
    calls = [
        ApiCall("cuGraphLaunch", "driver", 1.001, 1.002, 7),  # 1 ms in submit 3
        ApiCall("cuGraphLaunch", "driver", 1.021, 1.030, 7),  # 9 ms in submit 4
        ApiCall("cuStreamSynchronize", "driver", 1.011, 1.019, 7),  # in collect 2
        ApiCall("cuGraphLaunch", "driver", 1.001, 1.002, 8),  # another thread: in no range
        ApiCall("cudaGraphLaunch", "runtime", 1.009, 1.012, 7),  # straddles two ranges: in neither
    ]
    rows = summarize(calls, spans)
    by_call = {(row["range"], row["call"]): row for row in rows if "call" in row}
    assert set(by_call) == {("submit", "driver:cuGraphLaunch"), ("collect", "driver:cuStreamSynchronize")}
    launch = by_call[("submit", "driver:cuGraphLaunch")]
    assert launch["calls"] == 2 and launch["total_ms"] == pytest.approx(10.0) and launch["max_ms"] == pytest.approx(9.0)
    kinds = {row["range"]: row for row in rows if "spans" in row}
    assert kinds["submit"]["spans"] == 2 and kinds["submit"]["max_ms"] == pytest.approx(20.0)
    slowest = rows[-1]["slowest_in_submit"]
    assert [call["step"] for call in slowest] == [4, 3] and slowest[0]["ms"] == pytest.approx(9.0)


@pytest.mark.skipif(not cupti_dirs(), reason="no CUPTI (a CUDA toolkit or pip's nvidia-cuda-cupti) here")
def test_the_shim_builds_and_loads_against_cupti(tmp_path) -> None:
    api, reason = ApiCalls.load(tmp_path / "api_calls.so")
    assert api is not None, reason
    result = api.start()  # without a driver CUPTI refuses (999 here); with one it times from now on
    assert isinstance(result, int)
    api.stop()
    assert api.read() == [] and api.dropped() == 0  # no CUDA call was made


def test_without_a_device_the_script_says_why_and_fails() -> None:
    command = [sys.executable, "-m", "benchmarks.gpu.api_trace", "--shape", "tiny", "--lanes", "1", "--rows", "8",
               "--history", "16", "--steps", "1", "--variant", "fused"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "CUPTI" in done.stderr
