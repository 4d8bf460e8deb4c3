"""Shared helpers for the scheduler tests: a fake runner that samples deterministic tokens."""

from __future__ import annotations

from hypothesis import strategies as st

from scheduler import Request, Scheduler, SchedulerConfig, StepOutcome, StepPlan
from scheduler.cost_models import StepShape

# a `LinearCostModel`'s prices, for properties over any of them (prefill rate)
LINEAR_COSTS = {
    "fixed_ms": st.floats(0.0, 40.0),
    "row_ms": st.floats(0.001, 0.1),
    "lane_ms": st.floats(0.0, 3.0),
}

# a `LinearCostModel` of a small model's contended step (a few ms fixed, an eager form dearer) and a step target, as
# the budget rules' properties draw them (`test_first_runs`, `test_slack_guard`)
SMALL_STEP_COSTS = {
    "fixed_ms": st.floats(1.0, 30.0),
    "row_ms": st.floats(0.001, 0.05),
    "eager_ms": st.floats(0.0, 10.0),
    "target_ms": st.floats(5.0, 80.0),
}


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, **kwargs) -> Request:
    base = kwargs.pop("base", 1000)
    return Request(
        request_id=request_id,
        prompt_ids=[base + i for i in range(prompt_len)],
        max_tokens=max_tokens,
        **kwargs,
    )


def fake_outcome(plan: StepPlan, elapsed_ms: float = 10.0, token: int = 7, **kwargs) -> StepOutcome:
    sampled = {lane.request_id: token for lane in plan.lanes if lane.samples}
    return StepOutcome(sampled_tokens=sampled, elapsed_ms=elapsed_ms, **kwargs)


def run_step(scheduler: Scheduler, now: float, elapsed_ms: float = 10.0, token: int = 7) -> StepPlan:
    plan = scheduler.schedule(now)
    scheduler.update(plan, fake_outcome(plan, elapsed_ms, token), now + elapsed_ms / 1000.0)
    return plan


def drain(scheduler: Scheduler, max_steps: int = 10_000, elapsed_ms: float = 10.0) -> int:
    """Run steps until no work is left; returns how many steps it took."""
    now = 0.0
    for step in range(max_steps):
        if not scheduler.has_work:
            return step
        run_step(scheduler, now, elapsed_ms)
        now += elapsed_ms / 1000.0
    raise AssertionError(f"scheduler still has work after {max_steps} steps")


class LinearCostModel:
    """fixed + per prefill row + per decode lane milliseconds, and `eager_ms` more for a step that replays no compiled
    trace (default: a step of a large fixed cost, 22 ms, then 0.02 ms a row: the H200's 8B 4-bit beside 8 streams at
    16k, the same compiled or not)."""

    name = "linear"

    def __init__(self, fixed_ms: float = 22.0, row_ms: float = 0.02, lane_ms: float = 0.0, eager_ms: float = 0.0) -> None:
        self.fixed_ms, self.row_ms, self.lane_ms, self.eager_ms = fixed_ms, row_ms, lane_ms, eager_ms

    def predict(self, shape: StepShape) -> float:
        eager = 0.0 if shape.compiled else self.eager_ms
        return self.fixed_ms + self.row_ms * shape.prefill_rows + self.lane_ms * shape.decode_lanes + eager

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        pass

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        return None


def prompt_beside_a_stream(config: SchedulerConfig) -> tuple[Scheduler, StepPlan]:
    """One stream decoding (its first step took 10 ms), then a 5,000-token prompt arrives, priced by a
    `LinearCostModel`: the scheduler and its first plan, 1 ms after the stream's last token (no decode debt yet)."""
    scheduler = Scheduler(config)
    scheduler.add(make_request("stream", 10, max_tokens=100))
    run_step(scheduler, 0.0, elapsed_ms=10.0)
    scheduler.cost_model = LinearCostModel()
    scheduler.add(make_request("prompt", 5000, base=7000))
    return scheduler, scheduler.schedule(0.011)


def plan_after(scheduler: Scheduler, plan: StepPlan, elapsed_ms: float) -> StepPlan:
    """The next plan, once `plan` (made 11 ms in) has taken `elapsed_ms`."""
    now = 0.011 + elapsed_ms / 1000.0
    scheduler.update(plan, fake_outcome(plan, elapsed_ms=elapsed_ms), now)
    return scheduler.schedule(now)


class FakeShapes:
    """Traces and shapes run, by the chunk's rows (any history, any lanes); records what the scheduler asks for."""

    def __init__(self, traced_rows: set[int], met_rows: set[int]) -> None:
        self.traced_rows, self.met_rows = traced_rows, met_rows
        self.wanted: list[int] = []

    def traced(self, chunks, decode) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.traced_rows

    def met(self, chunks, decode) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.met_rows

    def want(self, chunks, decode) -> None:
        self.wanted.append(sum(chunk.rows for chunk in chunks))

    def stand_in(self, chunks, decode, limit_ms) -> None:
        return None  # no larger trace stands in here

    def stand_in_run_ms(self, chunks, decode, limit_ms) -> None:
        return None
