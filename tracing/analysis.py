"""What a capture says about latency: per-request TTFT and token gaps, step time by geometry, engine gaps split
into idle and active, budget halvings, span totals. Pure functions over decoded events (no I/O, no plotting).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from tracing import events as ev


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    p50: float
    p95: float
    max: float
    total: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        return cls(len(values), percentile(values, 50), percentile(values, 95), max(values, default=math.nan),
                   sum(values))


@dataclass
class RequestTimeline:
    request_id: str
    arrival: float | None = None
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None  # as the engine reported at finish
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.arrival is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def request_timelines(events: list[object]) -> dict[str, RequestTimeline]:
    timelines: dict[str, RequestTimeline] = {}

    def get(request_id: str) -> RequestTimeline:
        return timelines.setdefault(request_id, RequestTimeline(request_id))

    for event in events:
        if isinstance(event, ev.RequestArrived):
            line = get(event.request_id)
            line.arrival, line.prompt_tokens = event.t, event.prompt_tokens
        elif isinstance(event, ev.RequestAdmitted):
            get(event.request_id).admitted = event.t
        elif isinstance(event, ev.TokenCommitted):
            get(event.request_id).token_times.append(event.t)
        elif isinstance(event, ev.RequestFinished):
            line = get(event.request_id)
            line.finish, line.reason = event.t, event.reason
            line.output_tokens, line.cached_tokens = event.output_tokens, event.cached_tokens
    return timelines


def consistency_problems(timelines: dict[str, RequestTimeline]) -> list[str]:
    """Signs that a capture is incomplete or counts uncommitted output."""
    problems = []
    for line in timelines.values():
        if line.arrival is None:
            problems.append(f"{line.request_id}: events without a request_arrived")
        elif line.finish is None:
            problems.append(f"{line.request_id}: arrived but never finished")
        elif line.output_tokens != len(line.token_times):
            problems.append(
                f"{line.request_id}: finished with {line.output_tokens} output tokens but "
                f"{len(line.token_times)} were committed"
            )
    return problems


def row_band(rows: int) -> str:
    for limit, label in ((0, "0"), (63, "1-63"), (255, "64-255"), (1023, "256-1023")):
        if rows <= limit:
            return label
    return "1024+"


def lane_band(lanes: int) -> str:
    for limit, label in ((0, "0"), (4, "1-4"), (16, "5-16")):
        if lanes <= limit:
            return label
    return "17+"


@dataclass(frozen=True, slots=True)
class GeometryStats:
    path: str
    prefill_rows: str
    prefill_width: int
    decode_lanes: str
    time_ms: Distribution
    mean_abs_rel_error: float  # of the step's prediction, over steps that had one (NaN if none)


def step_time_by_geometry(events: list[object]) -> list[GeometryStats]:
    groups: dict[tuple, list[ev.StepExecuted]] = defaultdict(list)
    for event in events:
        if isinstance(event, ev.StepExecuted):
            key = (event.path, row_band(event.prefill_rows), event.prefill_width, lane_band(event.decode_lanes))
            groups[key].append(event)
    stats = []
    for key in sorted(groups):
        steps = groups[key]
        errors = [abs(s.predicted_ms - s.measured_ms) / s.measured_ms for s in steps
                  if s.predicted_ms is not None and s.measured_ms > 0]
        mean_error = sum(errors) / len(errors) if errors else math.nan
        stats.append(GeometryStats(*key, Distribution.of([s.measured_ms for s in steps]), mean_error))
    return stats


def step_intervals(events: list[object]) -> list[tuple[float, float]]:
    """(start, end) of every executed step, in time order."""
    return sorted((e.t - e.measured_ms / 1000, e.t) for e in events if isinstance(e, ev.StepExecuted))


def active_intervals(timelines: dict[str, RequestTimeline]) -> list[tuple[float, float]]:
    return [(line.arrival, line.finish) for line in timelines.values()
            if line.arrival is not None and line.finish is not None]


def engine_gaps(events: list[object], timelines: dict[str, RequestTimeline]) -> dict[str, Distribution]:
    """Time between consecutive steps, split by whether any request was in the system during the gap.

    Idle gaps (nothing to do) are not latency; active gaps are host overhead or stalls that streams feel.
    """
    busy = active_intervals(timelines)
    idle, active = [], []
    steps = step_intervals(events)
    for (_, end), (start, _) in zip(steps, steps[1:], strict=False):
        gap = max(0.0, start - end)
        overlaps = any(a < start and f > end for a, f in busy)
        (active if overlaps else idle).append(gap * 1000)
    return {"active_ms": Distribution.of(active), "idle_ms": Distribution.of(idle)}


@dataclass(frozen=True, slots=True)
class BudgetSummary:
    steps: int
    contended_steps: int
    halved_steps: int
    total_halvings: int
    budgets: dict[int, int]  # row budget -> how many steps had it
    reasons: dict[str, int]


def budget_summary(events: list[object]) -> BudgetSummary:
    planned = [e for e in events if isinstance(e, ev.StepPlanned)]
    budgets: dict[int, int] = defaultdict(int)
    reasons: dict[str, int] = defaultdict(int)
    for step in planned:
        budgets[step.row_budget] += 1
        reasons[step.budget_reason] += 1
    return BudgetSummary(
        steps=len(planned),
        contended_steps=sum(1 for s in planned if s.contended),
        halved_steps=sum(1 for s in planned if s.halvings),
        total_halvings=sum(s.halvings for s in planned),
        budgets=dict(sorted(budgets.items())),
        reasons=dict(sorted(reasons.items())),
    )


def span_totals(events: list[object]) -> dict[str, Distribution]:
    durations: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if isinstance(event, ev.Span):
            durations[event.name].append((event.end - event.start) * 1000)
    return {name: Distribution.of(values) for name, values in sorted(durations.items())}
