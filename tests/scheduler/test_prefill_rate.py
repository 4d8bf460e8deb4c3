"""`max_prefill_slowdown`: a contended chunk grows until a long prompt's prefill runs at least 1/x of its solo
speed (its predicted cost a row within x times a ceiling-sized uncontended chunk's), never to a step predicted over
`RATE_GROWTH_CAP` times what the step may take."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import LINEAR_COSTS, LinearCostModel, plan_after, prompt_beside_a_stream

from scheduler import SchedulerConfig
from scheduler.buckets import query_bucket
from scheduler.budget import RATE_GROWTH_CAP, choose_row_budget, fill_shortest_first
from scheduler.cost_models import PrefillChunk, StepShape


@pytest.mark.parametrize(
    "limit,slack,budget,reason",
    [
        (0.0, 1.5, 512, "halved:2+slack"),  # off: planned to 1.5 x the floor's 23.3 ms = 34.9
        # solo: 62.96 ms for 2,048 rows, 0.0307 a row; 1.5x that is met from 843 rows on
        (1.5, 1.5, 1024, "halved:2+slack+rate"),
        (1.2, 1.5, 1536, "halved:2+slack+rate"),  # 1,304 rows on
        # no slack: the step may take 20 ms, a grown one 40; 1,024 rows (42.5 ms) would pass that
        (1.5, 1.0, 768, "halved:5+rate"),
    ],
)
def test_a_contended_chunk_grows_until_the_prompt_runs_within_the_slowdown(limit, slack, budget, reason):
    """A step of 22 ms + 0.02 ms a row beside one stream, against a 20 ms target."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_ms=20.0, floor_slack=slack, max_prefill_slowdown=limit
    )
    _, plan = prompt_beside_a_stream(config)
    assert (plan.row_budget, plan.prefill_rows, plan.budget_reason) == (budget, budget, reason)


@pytest.mark.parametrize("limit,elapsed_ms,debt", [(1.5, 37.0, False), (1.5, 45.0, True), (0.0, 37.0, True)])
def test_a_grown_step_within_its_cap_puts_no_stream_in_decode_debt(limit, elapsed_ms, debt):
    """No slack, a 20 ms target: the grown step (768 rows, 37.4 ms predicted) may take up to twice the target before
    its streams are in debt; without the limit a 37 ms step is followed by a decode-only step."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_ms=20.0, floor_slack=1.0, max_prefill_slowdown=limit,
        debt_tolerance=1.0
    )
    scheduler, mixed = prompt_beside_a_stream(config)
    assert mixed.prefill_rows == (768 if limit else 64)
    after = plan_after(scheduler, mixed, elapsed_ms)
    assert (after.budget_reason == "decode-debt") is debt
    assert (after.prefill_rows == 0) is debt


def test_a_prompt_shorter_than_the_budget_grows_nothing():
    """Growing past the rows the prompt still needs adds no rows: the budget stays where the target put it."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_ms=20.0, floor_slack=1.0, max_prefill_slowdown=1.5
    )
    decision = choose_row_budget(
        config, LinearCostModel(), [PrefillChunk(rows=60, history=0)], 8, False, True, 20.0, allowance_ms=20.0
    )
    assert (decision.row_budget, decision.reason) == (64, "halved:5")


def test_the_slowdown_must_be_off_or_at_least_one():
    with pytest.raises(ValueError, match="max_prefill_slowdown"):
        SchedulerConfig(num_blocks=16, max_prefill_slowdown=0.5)
    SchedulerConfig(num_blocks=16, max_prefill_slowdown=1.0)


@settings(max_examples=200, deadline=None)
@given(
    **LINEAR_COSTS,
    lanes=st.integers(0, 16),
    target_ms=st.floats(5.0, 80.0),
    limit=st.floats(1.0, 3.0),
    rows=st.integers(1, 9000),
    history=st.integers(0, 16000),
)
def test_growth_only_adds_rows_within_its_cap_and_stops_where_the_rate_holds(
    fixed_ms, row_ms, lane_ms, lanes, target_ms, limit, rows, history
):
    """Against the same decision without the limit: the budget never shrinks; a grown step is predicted within the
    cap; and growth stops only where the rate holds, the prompt's rows or the ceiling are reached, or the next
    bucket would pass the cap."""
    model = LinearCostModel(fixed_ms, row_ms, lane_ms)
    demand = [PrefillChunk(rows=rows, history=history)]
    base = SchedulerConfig(num_blocks=4096, plan_headroom=1.0, step_target_ms=target_ms, floor_slack=1.0)
    limited = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_ms=target_ms, floor_slack=1.0,
        max_prefill_slowdown=limit
    )
    before = choose_row_budget(base, model, demand, lanes, False, True, target_ms, allowance_ms=target_ms)
    after = choose_row_budget(limited, model, demand, lanes, False, True, target_ms, allowance_ms=target_ms)

    def predict(budget: int) -> float:
        return model.predict(StepShape(fill_shortest_first(demand, budget), lanes))

    assert after.row_budget >= before.row_budget
    assert after.reason.removesuffix("+rate") == before.reason
    if not after.reason.endswith("+rate"):
        assert after.row_budget == before.row_budget
        assert after.predicted_ms == before.predicted_ms
    else:
        assert after.predicted_ms <= RATE_GROWTH_CAP * target_ms
    solo = model.predict(StepShape(fill_shortest_first(demand, base.row_ceiling), 0))
    reference_rows = min(rows, base.row_ceiling)
    rate_holds = after.predicted_ms <= limit * solo / reference_rows * after.row_budget
    reached = after.row_budget >= min(base.row_ceiling, rows)
    blocked = predict(min(query_bucket(after.row_budget + 1), base.row_ceiling)) > RATE_GROWTH_CAP * target_ms
    assert rate_holds or reached or blocked
