"""Trace events for the scheduler's decisions; called only when `trace.enabled`."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.budget import BudgetDecision
from scheduler.plan import StepPlan
from scheduler.request import Request
from tracing.events import LaneInfo, RequestAdmitted, StepPlanned
from tracing.sink import TraceSink


def emit_step_planned(
    trace: TraceSink, plan: StepPlan, decision: BudgetDecision, overtaken: Sequence[Request]
) -> None:
    lanes = tuple(
        LaneInfo(lane.request_id, lane.kind.value, lane.rows, lane.history, lane.path.value)
        for lane in plan.lanes
    )
    trace.emit(
        StepPlanned(
            t=trace.now(),
            step_id=plan.step_id,
            lanes=lanes,
            row_budget=plan.row_budget,
            budget_reason=plan.budget_reason,
            predicted_ms=plan.predicted_ms,
            contended=plan.contended,
            halvings=decision.halvings,
            overtakes=tuple(request.request_id for request in overtaken),
            preempted=plan.preempted_request_ids,
            limit_ms=plan.limit_ms,
        )
    )


def emit_admitted(trace: TraceSink, request: Request, cached_tokens: int) -> None:
    trace.emit(
        RequestAdmitted(
            t=trace.now(),
            request_id=request.request_id,
            cached_tokens=cached_tokens,
            overtaken=request.times_overtaken,
        )
    )
