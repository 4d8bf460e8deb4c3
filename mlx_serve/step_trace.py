"""The trace of one executed step: the engine's phase spans, the lane spans, and the step's geometry."""

from __future__ import annotations

from typing import Any

from scheduler import LaneKind, StepPlan
from tracing.events import Span, StepExecuted


def trace_step(trace: Any, plan: StepPlan, output: Any, t0: float, t1: float, t2: float) -> None:
    """t0: planning began; t1: planning ended (submission began); t2: the outcome was read back."""
    now = trace.now()
    trace.emit(Span("planning", t0, t1, plan.step_id))
    for name in ("preparation", "submission", "consumption"):
        trace.emit(Span(name, t1, t1 + output.phase_ms[name] / 1e3, plan.step_id))
        t1 += output.phase_ms[name] / 1e3
    trace.emit(Span("application", t2, now, plan.step_id))
    for span in output.lane_spans:
        trace.emit(span)
    prefill = [lane for lane in plan.lanes if lane.kind is LaneKind.PREFILL]
    rows = sum(lane.rows for lane in prefill)
    paths = {lane.path.value for lane in prefill} or {"gpu"}
    trace.emit(
        StepExecuted(
            t=now,
            step_id=plan.step_id,
            measured_ms=output.outcome.elapsed_ms,
            rows=plan.num_rows,
            prefill_rows=rows,
            decode_lanes=len(plan.lanes) - len(prefill),
            prefill_width=len(prefill),
            weighted_history=sum(lane.history * lane.rows for lane in prefill) / rows if rows else 0.0,
            path=paths.pop() if len(paths) == 1 else "mixed",
            predicted_ms=plan.predicted_ms,
            auxiliary=output.outcome.auxiliary,
            compiled=output.outcome.compiled,
            one_off=output.one_off,
        )
    )
