"""When the device finished a step, read on the device itself.

On MLX's CUDA backend `mx.async_eval` of a large step can block the host for most of the step's GPU time, so
host clocks book that time to whichever step the host was waiting on (the fourth H200 run's cost model saw
2k-row chunks at a quarter of their cost). Waiting for the device before each such step fixes the booking
but loses the overlap of one step's host work with the previous step's GPU work: the fifth run's chunks then
cost their host encode on top (8B: 64-row chunks at 23 ms, TTFT 10.9x solo).

`GpuStepClock` queues a one-thread kernel after a step's last output that writes CUDA's `%globaltimer`
(nanoseconds). Consecutive steps' stamps then give the interval each step occupied the device's stream,
which is what a decoding stream waits between two tokens; nothing blocks for it. Elsewhere there is no clock
(None) and the runner times steps on the host.
"""

from __future__ import annotations

import functools
from typing import Protocol

import mlx.core as mx
import numpy as np

# Inputs: after (any array: the stamp waits for it). Output: stamp [2] uint32, the low and high words.
STAMP_SOURCE = r"""
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  stamp[0] = (uint32_t)(t & 0xffffffffull);
  stamp[1] = (uint32_t)(t >> 32);
  (void)after;
"""

# a step queued within this long of the previous one's read-back followed it on the device without the engine
# idling between them; later than that, the stamps' difference would include idle time
CONTINUITY_S = 0.005


class StepClock(Protocol):
    def stamp(self, after: mx.array) -> mx.array:
        """A device array computed once `after` is: read it with `read_ns` after the step."""
        ...

    def read_ns(self, stamp: mx.array) -> int: ...


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_step_stamp", ["after"], ["stamp"], STAMP_SOURCE)


class GpuStepClock:
    """CUDA's global timer, stamped on the device's stream after a step's output."""

    def stamp(self, after: mx.array) -> mx.array:
        (out,) = _kernel()(
            inputs=[after], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)], output_dtypes=[mx.uint32]
        )
        mx.async_eval(out)
        return out

    def read_ns(self, stamp: mx.array) -> int:
        low, high = np.array(stamp, dtype=np.uint64).tolist()
        return int(low) | (int(high) << 32)


def step_interval_ms(host_ms: float, end_ns: int | None, previous_end_ns: int | None, continuous: bool) -> float:
    """A step's time: the device interval since the previous step's end when the step followed it without the
    engine idling, else `host_ms` (from its queuing, or the previous read-back, to its own)."""
    if end_ns is None or previous_end_ns is None or not continuous or end_ns < previous_end_ns:
        return host_ms
    return (end_ns - previous_end_ns) / 1e6
