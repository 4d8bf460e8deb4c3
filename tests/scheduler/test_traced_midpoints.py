"""`traced_midpoints`: a halved budget whose step replays a compiled trace grows by half (`budget_midpoints`) only
where the wider step replays one too; otherwise it keeps the halved budget and asks for the wider step's trace."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import SMALL_STEP_COSTS, LinearCostModel

from scheduler import SchedulerConfig
from scheduler.budget import choose_row_budget
from scheduler.cost_models import PrefillChunk

LANES = 8


def _small_model(fixed_ms: float = 8.0, row_ms: float = 0.008, eager_ms: float = 0.5) -> LinearCostModel:
    """A 0.6B-like step beside 8 streams: a small fixed cost, and an eager step a little dearer than a traced one."""
    return LinearCostModel(fixed_ms=fixed_ms, row_ms=row_ms, eager_ms=eager_ms)


def _decide(traced_rows: set[int], model=None, target_ms: float = 21.0, on: bool = True, prompt_rows: int = 16_000):
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.0, traced_midpoints=on
    )
    demand = [PrefillChunk(rows=prompt_rows, history=4096)]

    def traced(chunks) -> bool:
        return sum(chunk.rows for chunk in chunks) in traced_rows

    return choose_row_budget(config, model or _small_model(), demand, LANES, False, True, target_ms, traced)


def test_a_midpoint_that_would_run_eager_is_declined_and_its_trace_asked_for():
    """2,048 rows are over 21 ms, 1,024 (16.2 ms, traced) fit, 1,536 eager fit too (20.8 ms): without the rule the
    step grows to 1,536 rows and runs eager; with it, it stays at 1,024 compiled and wants 1,536's trace."""
    plain = _decide({1024}, on=False)
    assert (plain.row_budget, plain.reason) == (1536, "halved:1+half")
    kept = _decide({1024})
    assert (kept.row_budget, kept.reason) == (1024, "halved:1+kept-trace")
    assert kept.wanted == (PrefillChunk(rows=1536, history=4096),)
    assert kept.predicted_ms == pytest.approx(8.0 + 0.008 * 1024)


@pytest.mark.parametrize(
    "traced_rows,why",
    [({1024, 1536}, "the wider step has a trace too"), (set(), "the halved step runs eager as well")],
)
def test_a_midpoint_is_taken_where_it_loses_no_trace(traced_rows, why):
    decision = _decide(traced_rows)
    assert (decision.row_budget, decision.reason) == (1536, "halved:1+half"), why


@settings(max_examples=300, deadline=None)
@given(
    **SMALL_STEP_COSTS,
    prompt_rows=st.integers(1, 5000),
    traced_rows=st.sets(st.sampled_from([64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048])),
)
def test_the_rule_only_declines_midpoints_that_lose_a_trace(
    fixed_ms, row_ms, eager_ms, target_ms, prompt_rows, traced_rows
):
    """Against the decision without it: never larger; where the two differ, the plain one took a midpoint whose step
    runs eager, the kept one is the halved budget before it, which runs compiled, and asks for a trace at least as
    wide (the wider step's, or a larger step's that the halving had already turned down for want of one)."""
    model = _small_model(fixed_ms, row_ms, eager_ms)
    plain = _decide(traced_rows, model, target_ms, on=False, prompt_rows=prompt_rows)
    kept = _decide(traced_rows, model, target_ms, on=True, prompt_rows=prompt_rows)
    if kept.row_budget == plain.row_budget:
        assert kept.reason == plain.reason
        return
    assert kept.row_budget < plain.row_budget
    assert plain.reason.endswith("+half") and kept.reason.endswith("+kept-trace")
    assert plain.reason.split("+")[0] == kept.reason.split("+")[0]  # the same halvings
    assert min(plain.row_budget, prompt_rows) not in traced_rows
    assert min(kept.row_budget, prompt_rows) in traced_rows
    assert sum(chunk.rows for chunk in kept.wanted) >= min(plain.row_budget, prompt_rows)
