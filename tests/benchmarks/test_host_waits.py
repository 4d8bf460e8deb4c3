"""The host_waits shim (`benchmarks/gpu/host_waits.c`) and its reader: built here, preloaded into a subprocess that
evaluates on MLX's CPU backend, whose main thread waits for the stream thread through pthread_cond_wait."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu.host_waits import HostWaits, overlap_ms
from benchmarks.gpu.ours import _overlapping, _submission_waits
from tracing.events import Span, StepExecuted

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "benchmarks" / "gpu" / "host_waits.c"

needs_shim = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux and a C compiler"
)

# the main thread's waits while it evaluates matmuls, and the perf_counter bracketing them
EVALS = """
import json, threading, time
import mlx.core as mx
from benchmarks.gpu.host_waits import HostWaits
waits = HostWaits.load()
a = mx.ones((1024, 1024))
mx.eval(a)
waits.clear()
t0 = time.perf_counter()
for i in range(4):
    mx.eval(a @ a + i)
t1 = time.perf_counter()
main = waits.read(threading.get_native_id())
print(json.dumps({"t0": t0, "t1": t1, "main": main, "all": len(waits.read()), "no_thread": len(waits.read(-1)),
                  "dropped": waits.dropped()}))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shim") / "host_waits.so"
    build = ["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(SHIM), "-ldl", "-lpthread"]
    subprocess.run(build, check=True)
    return out


def run_preloaded(shim: Path, code: str, **env: str) -> dict:
    environ = {**os.environ, "LD_PRELOAD": str(shim), "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environ,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_shim
def test_the_main_thread_waits_inside_its_evals_on_perf_counters_clock(shim):
    got = run_preloaded(shim, EVALS)
    main, t0, t1 = got["main"], got["t0"], got["t1"]
    assert main, "MLX's CPU eval waits for its stream thread in pthread_cond_wait"
    total = sum(end - start for start, end in main)
    assert 0 < total <= t1 - t0
    # CLOCK_MONOTONIC ns / 1e9 is perf_counter's scale: every wait lies between the two perf_counter reads
    assert all(t0 <= start < end <= t1 for start, end in main)
    assert total > 0.5 * (t1 - t0), "the main thread spends the evals waiting on the stream thread"
    assert got["all"] >= len(main) and got["no_thread"] == 0  # filtered by tid
    assert got["dropped"] == 0


@needs_shim
def test_waits_under_the_threshold_are_not_recorded(shim):
    got = run_preloaded(shim, EVALS, HOST_WAITS_MIN_US=str(10**9))  # 1000 s
    assert got["main"] == [] and got["all"] == 0


def test_no_reader_without_the_shim():
    assert "host_waits" not in os.environ.get("LD_PRELOAD", "")
    assert HostWaits.load() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="perf_counter is CLOCK_MONOTONIC on Linux")
def test_perf_counter_is_clock_monotonic():
    assert time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    before = time.perf_counter()
    mono = time.clock_gettime(time.CLOCK_MONOTONIC)
    after = time.perf_counter()
    assert before <= mono <= after


def test_overlap_ms_clips_at_both_ends():
    waits = [(0.0, 2.0), (3.0, 4.0), (5.0, 9.0), (20.0, 21.0)]
    assert overlap_ms(waits, 1.0, 6.0) == pytest.approx(1e3 * (1.0 + 1.0 + 1.0))
    assert overlap_ms(waits, 3.5, 3.75) == pytest.approx(250.0)  # inside one wait
    assert overlap_ms(waits, 10.0, 19.0) == 0.0  # between waits
    assert overlap_ms(waits, 22.0, 30.0) == 0.0
    assert overlap_ms([], 0.0, 1.0) == 0.0


def test_overlapping_finds_exactly_the_waits_touching_the_window():
    waits = [(0.0, 2.0), (3.0, 4.0), (5.0, 9.0), (20.0, 21.0)]
    assert _overlapping(waits, 1.0, 6.0) == waits[:3]
    assert _overlapping(waits, 2.5, 2.9) == []
    assert _overlapping(waits, 4.0, 5.0) == [(3.0, 4.0), (5.0, 9.0)]  # touching at both ends
    assert _overlapping(waits, 25.0, 30.0) == []


def step(step_id: int, prefill_rows: int, decode_lanes: int) -> StepExecuted:
    return StepExecuted(t=0.0, step_id=step_id, measured_ms=1.0, rows=prefill_rows + decode_lanes,
                        prefill_rows=prefill_rows, decode_lanes=decode_lanes, prefill_width=int(prefill_rows > 0),
                        weighted_history=0.0, path="gpu")  # fmt: skip


def test_submission_waits_sum_each_submission_span():
    # submissions of steps 1 (mixed) and 2, 3 (decode only), in seconds; step 3 has no waits
    events = [Span("submission", 1.000, 1.010, 1), Span("planning", 1.010, 1.020, 1),
              Span("submission", 2.000, 2.004, 2), Span("submission", 3.000, 3.002, 3)]  # fmt: skip
    waits = [(1.002, 1.006), (1.008, 1.015), (1.5, 1.6), (1.999, 2.001)]
    mixed, alone = [step(1, 32, 2)], [step(2, 0, 2), step(3, 0, 2)]
    got = _submission_waits(events, waits, mixed, alone)
    assert got["mixed"] == {"steps": 1, "submission_ms_p50": 10.0, "submission_ms_max": 10.0, "wait_ms_p50": 6.0,
                            "wait_ms_max": 6.0}  # fmt: skip
    assert got["decode_only"]["steps"] == 2
    assert got["decode_only"]["submission_ms_max"] == 4.0
    assert got["decode_only"]["wait_ms_p50"] == 0.5 and got["decode_only"]["wait_ms_max"] == 1.0
    assert got["most_waited"] == [[1, 10.0, 6.0], [2, 4.0, 1.0], [3, 2.0, 0.0]]

