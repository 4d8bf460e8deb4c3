"""The device step clock on CUDA: stamps after a step's output, in nanoseconds of the GPU's global timer."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from mlx_serve.kernels.step_clock import GpuStepClock

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the step clock reads CUDA's %globaltimer")


@on_cuda
@pytest.mark.device
def test_stamps_bracket_the_work_between_them():
    clock = GpuStepClock()
    a = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    mx.eval(a)
    before = clock.stamp(a)
    mx.eval(before)
    t0 = time.perf_counter()
    y = a
    for _ in range(40):
        y = (y @ a) * (1 / 64)
    after = clock.stamp(y)  # waits for the whole chain
    mx.eval(after)
    host_ms = (time.perf_counter() - t0) * 1e3
    device_ms = (clock.read_ns(after) - clock.read_ns(before)) / 1e6
    # the chain's GPU time is most of the host's wall time; the stamps cannot span more than it (plus the sync)
    assert 0.5 * host_ms <= device_ms <= host_ms + 1.0, (device_ms, host_ms)
