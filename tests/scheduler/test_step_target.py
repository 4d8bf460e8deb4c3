"""The adaptive step target (`step_target_factor`, `--step-target-ms auto`): a contended step may take a multiple
of the measured decode-only step, never less than the floor, the fixed target until one is measured."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scheduler_helpers import fake_outcome, make_request, plan_after, prompt_beside_a_stream, run_step

from scheduler import Scheduler, SchedulerConfig
from scheduler.cost_models import EmaCostModel
from scheduler.plan import Lane, LaneKind, StepOutcome, StepPlan
from scheduler.step_target import DECODE_WINDOW, StepTarget


def _plan(decode: int, prefill_rows: int = 0) -> StepPlan:
    lanes = [Lane(f"d{i}", LaneKind.DECODE, (1,), 10, (0,), True) for i in range(decode)]
    if prefill_rows:
        lanes.append(Lane("p", LaneKind.PREFILL, (1,) * prefill_rows, 0, (1,), False))
    return StepPlan(0, tuple(lanes), prefill_rows, "t", None, bool(decode))


def test_the_fixed_target_holds_until_a_decode_step_is_measured() -> None:
    target = StepTarget(500.0, factor=3.0, floor_ms=20.0)
    assert target.ms == 500.0
    target.observe(_plan(8, prefill_rows=256), StepOutcome({}, 40.0))  # a mixed step teaches nothing
    target.observe(_plan(8), StepOutcome({}, math.nan))  # a step left in flight: no time yet
    target.observe(_plan(8), StepOutcome({}, 10.0, failed={"d0": "boom"}))
    assert target.ms == 500.0
    target.observe(_plan(8), StepOutcome({}, 10.0))
    assert target.ms == 30.0
    target.observe(_plan(8), StepOutcome({}, 8.0))  # the median of 10 and 8: 9 -> 27 ms
    assert target.ms == 27.0
    for _ in range(20):
        target.observe(_plan(8), StepOutcome({}, 1.0))
    assert target.ms == 20.0  # the floor


def test_a_stalled_decode_step_or_two_leave_the_target_where_it_was() -> None:
    """The thirty-ninth run's H100 sequence: 4.3 ms decode steps, then two whose submission stalled (29.2, 35.2 ms).
    An EMA of weight 0.25 made the target 50 ms; the window's median keeps 3 x 4.3, so the 15 ms floor."""
    target = StepTarget(500.0, factor=3.0, floor_ms=15.0)
    for _ in range(10):
        target.observe(_plan(8), StepOutcome({}, 4.3))
    for stalled in (29.2, 35.2):
        target.observe(_plan(8), StepOutcome({}, stalled))
    assert target.ms == 15.0
    for _ in range(DECODE_WINDOW // 2 + 1):  # a real change (more streams: 12 ms steps) is followed within half a window
        target.observe(_plan(8), StepOutcome({}, 12.0))
    assert target.ms == 36.0


def test_without_a_factor_the_target_is_fixed() -> None:
    target = StepTarget(120.0)
    target.observe(_plan(8), StepOutcome({}, 10.0))
    assert target.ms == 120.0


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 512), st.floats(0.01, 1e4)), max_size=40),
       st.floats(0.5, 8.0), st.floats(0.0, 100.0))  # fmt: skip
def test_the_adaptive_target_is_the_fixed_one_or_a_floored_multiple_of_a_decode_step(steps, factor, floor) -> None:
    target = StepTarget(500.0, factor=factor, floor_ms=floor)
    decode_times = []
    for decode, rows, elapsed in steps:
        target.observe(_plan(decode, rows), StepOutcome({}, elapsed))
        if decode and not rows:
            decode_times.append(elapsed)
    if not decode_times:
        assert target.ms == 500.0
    else:
        assert target.ms >= floor
        assert target.ms <= max(floor, factor * max(decode_times)) * (1 + 1e-9)
        assert target.ms >= max(floor, factor * min(decode_times)) * (1 - 1e-9)


def test_a_contended_budget_is_cut_to_the_measured_decode_steps_multiple() -> None:
    """10 ms decode steps: at factor 3 the target is 30 ms, and a 0.1 ms/row model cuts a 2,048-row budget to 256."""
    config = SchedulerConfig(num_blocks=4096, step_target_factor=3.0, step_target_floor_ms=5.0)
    scheduler = Scheduler(config)
    scheduler.add(make_request("stream", 10, max_tokens=100))
    for step in range(4):
        run_step(scheduler, step * 0.01, elapsed_ms=10.0)  # prefill, then decode-only steps of 10 ms
    assert scheduler.step_target.ms == 30.0
    model = scheduler.cost_model = EmaCostModel()
    model.ms_per_row = 0.1
    scheduler.add(make_request("prompt", 5000, base=7000))
    plan = scheduler.schedule(0.05)
    assert plan.row_budget == 256 and plan.prefill_rows == 256 and plan.predicted_ms <= 30.0
    fixed = Scheduler(SchedulerConfig(num_blocks=4096))  # the seed's 500 ms: the ceiling fits
    fixed.add(make_request("stream", 10, max_tokens=100))
    for step in range(4):
        run_step(fixed, step * 0.01, elapsed_ms=10.0)
    fixed.cost_model = model
    fixed.add(make_request("prompt", 5000, base=7000))
    assert fixed.schedule(0.05).row_budget == 2048  # the ceiling (the decode row counts toward it)


def test_decode_debt_uses_the_adaptive_target() -> None:
    """A 90 ms mixed step is debt against 3 x 10 ms decode steps (it would not be against the seed's 500)."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=4096, step_target_factor=3.0))
    scheduler.add(make_request("stream", 10, max_tokens=100))
    for step in range(4):
        run_step(scheduler, step * 0.01, elapsed_ms=10.0)
    scheduler.add(make_request("prompt", 5000, base=7000))
    mixed = scheduler.schedule(0.05)
    assert mixed.prefill_rows > 0
    scheduler.update(mixed, fake_outcome(mixed, elapsed_ms=90.0), 0.14)
    assert scheduler.schedule(0.14).budget_reason == "decode-debt"


def plan_beside_a_stream(config: SchedulerConfig, ms_per_row: float) -> StepPlan:
    scheduler = Scheduler(config)
    scheduler.add(make_request("stream", 10, max_tokens=100))
    run_step(scheduler, 0.0, elapsed_ms=10.0)
    scheduler.cost_model = EmaCostModel()
    scheduler.cost_model.ms_per_row = ms_per_row
    scheduler.add(make_request("prompt", 5000, base=7000))
    return scheduler.schedule(0.05)


@pytest.mark.parametrize("midpoints,budget,reason", [(True, 384, "halved:3+half"), (False, 256, "halved:3")])
def test_a_halved_budget_takes_its_midpoint_when_that_is_predicted_within_the_target(midpoints, budget, reason):
    """0.1 ms a row against 40 ms: halving stops at 256 rows (25.6 ms); 384 rows (38.4 ms) still fit, 512 do not."""
    config = SchedulerConfig(num_blocks=4096, step_target_ms=40.0, budget_midpoints=midpoints, plan_headroom=1)
    plan = plan_beside_a_stream(config, 0.1)
    assert (plan.row_budget, plan.prefill_rows, plan.budget_reason) == (budget, budget, reason)
    assert plan.predicted_ms <= 40.0
    plan = plan_beside_a_stream(config, 0.12)  # 384 rows: 46 ms, over the target: the plain halving stands
    assert (plan.row_budget, plan.budget_reason) == (256, "halved:3")


@pytest.mark.parametrize("headroom,budget", [(1.0, 384), (0.9, 256), (0.5, 192)])
def test_contended_budgets_are_planned_to_the_headroom_fraction_of_the_target(headroom, budget):
    """0.1 ms a row against 40 ms: 384 rows (38.4 ms) fit the whole target, not 90% of it (36 ms); half of it
    (20 ms) leaves 192 (128, then its midpoint). Uncontended steps keep the ceiling whatever the headroom."""
    config = SchedulerConfig(num_blocks=4096, step_target_ms=40.0, plan_headroom=headroom)
    plan = plan_beside_a_stream(config, 0.1)
    assert plan.row_budget == budget and plan.predicted_ms <= 40.0 * headroom
    alone = Scheduler(config)
    alone.add(make_request("prompt", 5000))
    assert alone.schedule(0.0).row_budget == config.row_ceiling


@pytest.mark.parametrize("headroom", [0.0, -0.5, 1.01])
def test_a_headroom_outside_zero_to_one_is_refused(headroom):
    with pytest.raises(ValueError, match="plan_headroom"):
        SchedulerConfig(num_blocks=16, plan_headroom=headroom)


@pytest.mark.parametrize(
    "slack,target,budget,reason",
    [
        (1.25, 20.0, 256, "halved:3+slack"),  # nothing fits 20 ms: allowed 1.25 x the floor's 23.3 = 29.1 (256: 27.1)
        (1.0, 20.0, 64, "halved:5"),  # no slack: the floor, over the target
        (1.25, 15.0, 64, "halved:5"),  # the floor 1.55x over the target: the fit is more likely wrong
        (1.5, 30.0, 512, "halved:2+slack"),  # the floor fits, yet 1.5 x 23.3 = 34.9 is more than the target
        (1.5, 40.0, 768, "halved:2+half"),  # the target is more than the slack allows: as without it
    ],
)
def test_a_step_may_take_the_slack_times_the_floor_step_where_that_is_more_than_the_target(slack, target, budget, reason):
    """A step of 22 ms + 0.02 ms a row: the floor (64 rows) is 23.3 ms. Where `floor_slack` times that is more than
    the target, the budget plans to it; where the floor is over the target by more than `SLACK_WITHIN`, or the slack
    is 1, the target holds."""
    config = SchedulerConfig(num_blocks=4096, plan_headroom=1.0, step_target_ms=target, floor_slack=slack)
    _, plan = prompt_beside_a_stream(config)
    assert (plan.row_budget, plan.prefill_rows, plan.budget_reason) == (budget, budget, reason)
    assert plan.predicted_ms <= max(target, slack * (22.0 + 0.02 * 64))
    with pytest.raises(ValueError, match="floor_slack"):
        SchedulerConfig(num_blocks=16, floor_slack=0.9)


@pytest.mark.parametrize("headroom", [1.0, 0.9])
def test_a_step_planned_to_the_floor_slack_keeps_its_allowance_whatever_the_headroom(headroom):
    """The headroom keeps a target-bound step's spread under the target. A step planned to the floor slack is past
    the target by design, so it keeps the slack's allowance: 256 rows (27.1 of 1.25 x 23.3 = 29.1 ms) at both (H100,
    8B 4-bit: the same budgets replayed at 1.0 and 0.9, forty-eighth run)."""
    config = SchedulerConfig(num_blocks=4096, step_target_ms=20.0, floor_slack=1.25, plan_headroom=headroom)
    _, plan = prompt_beside_a_stream(config)
    assert (plan.row_budget, plan.budget_reason) == (256, "halved:3+slack")
    assert plan.predicted_ms <= 1.25 * (22.0 + 0.02 * 64)


@pytest.mark.parametrize("slack,elapsed_ms,debt", [(1.25, 27.0, False), (1.25, 35.0, True), (1.0, 27.0, True)])
def test_a_step_within_the_floor_slack_puts_no_stream_in_decode_debt(slack, elapsed_ms, debt):
    """Where even the floor step (23.3 ms) is over the 20 ms target, a debt step cannot bring the next contended step
    under it: a mixed step within the slack's allowance (1.25 x 23.3 = 29.1 ms) is followed by another mixed step,
    one past it (35 ms) by a decode-only step, and without slack any step over the target is debt."""
    config = SchedulerConfig(num_blocks=4096, step_target_ms=20.0, floor_slack=slack, debt_tolerance=1.0)
    scheduler, mixed = prompt_beside_a_stream(config)
    assert mixed.prefill_rows > 0
    after = plan_after(scheduler, mixed, elapsed_ms)
    assert (after.budget_reason == "decode-debt") is debt
    assert (after.prefill_rows == 0) is debt


@pytest.mark.parametrize("tolerance,elapsed_ms,debt", [(1.25, 24.0, False), (1.25, 26.0, True), (1.0, 24.0, True)])
def test_a_step_within_the_debt_tolerance_of_its_allowance_puts_no_stream_in_decode_debt(tolerance, elapsed_ms, debt):
    """No slack, a 20 ms target: with `debt_tolerance` 1.25 a mixed step of up to 25 ms is followed by another mixed
    step (a decode-only one would not shorten the 24 ms gap already suffered), one of 26 ms by a decode-only step."""
    config = SchedulerConfig(num_blocks=4096, step_target_ms=20.0, floor_slack=1.0, debt_tolerance=tolerance)
    scheduler, mixed = prompt_beside_a_stream(config)
    assert mixed.prefill_rows > 0
    after = plan_after(scheduler, mixed, elapsed_ms)
    assert (after.budget_reason == "decode-debt") is debt
    assert (after.prefill_rows == 0) is debt
    with pytest.raises(ValueError, match="debt_tolerance"):
        SchedulerConfig(num_blocks=16, debt_tolerance=0.9)
