"""`slack_guard_rows`: the floor slack (a contended step may take `floor_slack` x the floor step's prediction) only
where a step of that many rows, compiled where the engine compiles prefill, is predicted over the target, and to at
most that step's price. Where the target admits such a step, the fixed cost does not fill it: the slack there only
came from a floor step priced eager (its shape untraced) and let ceiling-sized chunks run far over the target (H100
0.6B, fortieth run). Past the guard's rows the fixed cost is spread already: a floor priced dear let 1,024-row
chunks run (H100 8B 4-bit, sixty-second run)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import SMALL_STEP_COSTS, LinearCostModel

from scheduler import SchedulerConfig
from scheduler.budget import choose_row_budget, slack_allowance_ms, slack_guard_ms
from scheduler.cost_models import PrefillChunk

LANES = 8
DEMAND = [PrefillChunk(rows=16_000, history=2048)]


def _untraced_floor(chunks) -> bool:
    return sum(chunk.rows for chunk in chunks) != 64  # every shape traced but the floor's


def _decide(guard_rows: int, model, target_ms: float):
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.5, slack_guard_rows=guard_rows
    )
    return choose_row_budget(config, model, DEMAND, LANES, False, True, target_ms, _untraced_floor)


def test_a_floor_priced_eager_gives_no_slack_where_many_rows_fit_compiled():
    """A 0.6B-like step (6 ms fixed, 0.005 ms a row) whose eager form costs 10 ms more, against a 14 ms target: its
    untraced floor step ran eager at 16.3 ms, and 1.5 x that (24.5 ms) once let the 2,048-row ceiling run (16.2 ms).
    Priced compiled (6.3 ms) the floor gives no slack, guarded or not: 1,024 rows and their midpoint, 1,536 (13.7 ms)."""
    model = LinearCostModel(fixed_ms=6.0, row_ms=0.005, eager_ms=10.0)
    for guard_rows in (0, 512):
        decision = _decide(guard_rows, model, 14.0)
        assert (decision.row_budget, decision.reason, decision.limit_ms) == (1536, "halved:1+half", 14.0)
        assert decision.predicted_ms == pytest.approx(6.0 + 0.005 * 1536)


def test_an_untraced_floor_keeps_the_slack_its_compiled_form_allows():
    """H100, 8B 4-bit beside 8 streams (forty-sixth run): 64 rows compiled 15 ms, the floor's 128 filled rows 18 ms
    compiled and 26 eager. Priced eager, the floor passed `SLACK_WITHIN` x the 16 ms target, the slack went off and
    64-row steps read the rest of a 16k prompt; priced compiled it stays, 1.75 x 18 ms."""
    model = LinearCostModel(fixed_ms=12.8, row_ms=0.04, eager_ms=8.0)  # 128 rows: 17.9 compiled, 25.9 eager
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, row_quantum=64, floor_slack=1.75
    )

    def floor_untraced(chunks) -> bool:
        return sum(chunk.rows for chunk in chunks) != 128

    allowance = slack_allowance_ms(config, model, DEMAND, LANES, 16.0, floor_untraced)
    assert allowance == pytest.approx(1.75 * (12.8 + 0.04 * 128))
    decision = choose_row_budget(config, model, DEMAND, LANES, False, True, 16.0, floor_untraced)
    assert decision.reason.endswith("+slack") and decision.row_budget >= 256
    assert decision.predicted_ms <= allowance


def test_a_fixed_cost_that_fills_the_target_keeps_its_slack_up_to_the_guards_rows():
    """An 8B 4-bit-like step (22 ms fixed, 0.02 ms a row, one form) against a 20 ms target: 512 rows (32.24 ms) do
    not fit, so the slack stays; 1.5 x the floor's 23.28 ms is 34.92, and the guard's own step caps it at 32.24."""
    model = LinearCostModel()
    loose, guarded = (_decide(rows, model, 20.0) for rows in (0, 512))
    assert loose.limit_ms == pytest.approx(1.5 * (22.0 + 0.02 * 64)) and loose.reason.endswith("+slack")
    assert guarded.limit_ms == pytest.approx(22.0 + 0.02 * 512) and guarded.reason.endswith("+slack")
    assert guarded.row_budget == 512 and guarded.predicted_ms <= guarded.limit_ms


def test_a_floor_priced_dear_buys_no_more_than_the_guards_rows():
    """H100, 8B 4-bit beside 8 streams (sixty-second run, a slow host): eager 64-row warm-up steps of ~28 ms taught the
    fit 3.2 ms a decode lane, so it priced the compiled floor step at ~28 ms against a 26.5 ms target; 2 x that let
    1,024-row steps run 46-58 ms, and the streams' longest gap was 6x their median. Capped at the guard's 512-row
    step the chunk stops at 512 rows, whatever the slack multiplies."""
    model = LinearCostModel(fixed_ms=25.0, row_ms=0.025)  # floor (64 rows) 26.6 ms, 512 rows 37.8, 1,024 rows 50.6
    for slack in (2.0, 3.0):
        config = SchedulerConfig(num_blocks=4096, plan_headroom=0.9, kv_bucket=1024, floor_slack=slack)
        allowance = slack_allowance_ms(config, model, DEMAND, LANES, 26.5, _untraced_floor)
        assert allowance == pytest.approx((25.0 + 0.025 * 512) / 0.9)
        decision = choose_row_budget(config, model, DEMAND, LANES, False, True, 26.5, _untraced_floor, allowance)
        assert decision.row_budget == 512 and decision.reason.endswith("+slack")


def test_the_guard_prices_its_rows_compiled_only_where_prefill_compiles():
    model = LinearCostModel(fixed_ms=6.0, row_ms=0.005, eager_ms=10.0)  # 512 rows: 8.6 ms compiled, 18.6 eager
    config = SchedulerConfig(num_blocks=4096, slack_guard_rows=512)
    assert slack_guard_ms(config, model, DEMAND, LANES, _untraced_floor) <= 14.0
    assert slack_guard_ms(config, model, DEMAND, LANES, None) > 14.0  # no compiled prefill: its one form
    assert slack_guard_ms(config, model, DEMAND, LANES, _untraced_floor) > 8.0  # 512 rows: over 8 ms
    assert slack_guard_ms(config, model, [PrefillChunk(100, 0)], LANES, _untraced_floor) <= 8.0  # all that is left fits
    assert slack_guard_ms(SchedulerConfig(num_blocks=4096, slack_guard_rows=0), model, DEMAND, LANES, None) is None
    with pytest.raises(ValueError, match="slack_guard_rows"):
        SchedulerConfig(num_blocks=16, slack_guard_rows=-1)


@settings(max_examples=300, deadline=None)
@given(
    **SMALL_STEP_COSTS,
    guard_rows=st.sampled_from([0, 128, 256, 512, 1024]),
)
def test_the_guard_only_ever_narrows_the_slack(fixed_ms, row_ms, eager_ms, target_ms, guard_rows):
    """Guarded, what a step may take is the target exactly where the guard's step fits it, compiled; elsewhere the
    unguarded allowance, at most the guard's step's price and never under the target."""
    model = LinearCostModel(fixed_ms, row_ms, eager_ms=eager_ms)
    loose = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.5, slack_guard_rows=0
    )
    guarded = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.5, slack_guard_rows=guard_rows
    )
    unguarded = slack_allowance_ms(loose, model, DEMAND, LANES, target_ms, _untraced_floor)
    allowed = slack_allowance_ms(guarded, model, DEMAND, LANES, target_ms, _untraced_floor)
    guard_ms = fixed_ms + row_ms * guard_rows
    if not guard_rows:
        assert allowed == unguarded
    elif guard_ms <= target_ms:
        assert allowed == target_ms
    else:
        assert allowed == pytest.approx(max(target_ms, min(unguarded, guard_ms)))
