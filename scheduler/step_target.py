"""The time a contended step may take: fixed (`--step-target-ms`), or a multiple of the measured decode step.

A fixed target suits one machine and one model: 500 ms is the seed's Apple-GPU value, while an H200 decodes an
8B model's 8 streams in ~10 ms a step, where 500 ms of prefill beside them would freeze the streams for half a
second. With a factor (`--step-target-ms auto`: 3 by default, `--step-target-factor`), a contended step may take
that many decode steps, whatever the hardware, the model and the load: live streams keep at least a third of
their calm speed while a long prompt is read. Until a decode-only step has been measured, the fixed target holds.
"""

from __future__ import annotations

import math

from scheduler.plan import StepOutcome, StepPlan

EMA_WEIGHT = 0.25


class StepTarget:
    def __init__(self, fixed_ms: float, factor: float = 0.0, floor_ms: float = 0.0) -> None:
        self.fixed_ms = fixed_ms
        self.factor = factor  # 0: always the fixed target
        self.floor_ms = floor_ms  # the adaptive target's least value (a decode step of microseconds is noise)
        self.decode_step_ms: float | None = None  # EMA of measured decode-only steps

    @property
    def ms(self) -> float:
        if self.factor <= 0 or self.decode_step_ms is None:
            return self.fixed_ms
        return max(self.floor_ms, self.factor * self.decode_step_ms)

    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Learn from a decode-only step's measured time (a step updated before its time is known has none)."""
        if self.factor <= 0 or outcome.failed or outcome.auxiliary or plan.prefill_rows or not plan.lanes:
            return
        elapsed = outcome.elapsed_ms
        if not (isinstance(elapsed, float | int) and math.isfinite(elapsed) and elapsed > 0):
            return
        previous = self.decode_step_ms
        self.decode_step_ms = elapsed if previous is None else previous + EMA_WEIGHT * (elapsed - previous)
