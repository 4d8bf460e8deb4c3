"""The time a contended step may take: fixed (`--step-target-ms`), or a multiple of the measured decode step.

A fixed target suits one machine and one model: 500 ms is the seed's Apple-GPU value, while an H200 decodes an
8B model's 8 streams in ~10 ms a step, where 500 ms of prefill beside them would freeze the streams for half a
second. With a factor (`--step-target-ms auto`: 3 by default, `--step-target-factor`), a contended step may take
that many decode steps, whatever the hardware, the model and the load: live streams keep at least a third of
their calm speed while a long prompt is read. Until a decode-only step has been measured, the fixed target holds.

The decode step is the median of the last `DECODE_WINDOW` decode-only steps, not a moving average: on an H100 (0.6B,
thirty-ninth run) one or two decode-only steps whose submission stalled 29-53 ms, against 4-5 ms, lifted an EMA of
weight 0.25 three- to fourfold, the target to 30-50 ms, and the next mixed steps were planned to it (25-38 ms, in 4
of 19 runs; the stall itself stayed each such run's longest gap). A median ignores such steps and still follows a
real change (more streams) within half a window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from scheduler.plan import StepOutcome, StepPlan

DECODE_WINDOW = 15  # decode-only steps the median is taken over


class StepTarget:
    def __init__(self, fixed_ms: float, factor: float = 0.0, floor_ms: float = 0.0) -> None:
        self.fixed_ms = fixed_ms
        self.factor = factor  # 0: always the fixed target
        self.floor_ms = floor_ms  # the adaptive target's least value (a decode step of microseconds is noise)
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)  # the last measured decode-only steps, ms
        self.decode_step_ms: float | None = None  # their median

    @property
    def ms(self) -> float:
        if self.factor <= 0 or self.decode_step_ms is None:
            return self.fixed_ms
        return max(self.floor_ms, self.factor * self.decode_step_ms)

    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Learn from a decode-only step's measured time (a step updated before its time is known has none)."""
        elapsed = decode_only_ms(plan, outcome) if self.factor > 0 else None
        if elapsed is None:
            return
        self._decode_steps.append(elapsed)
        self.decode_step_ms = statistics.median(self._decode_steps)


def decode_only_ms(plan: StepPlan, outcome: StepOutcome) -> float | None:
    """A decode-only step's measured time; None for any other step, a failed or auxiliary one, or one with no time."""
    if outcome.failed or outcome.auxiliary or plan.prefill_rows or not plan.lanes:
        return None
    elapsed = outcome.elapsed_ms
    if not (isinstance(elapsed, float | int) and math.isfinite(elapsed) and elapsed > 0):
        return None
    return float(elapsed)
