"""`checked_fill`: a contended budget's row-tile fill that carries it past its own query bucket (8 decode lanes in
64-row tiles: 256 -> 384 rows, 512 -> 768) is kept ("on") only where the grown step is predicted within what it may
take, or ("untraced") also where it keeps the compiled trace the budget's own step replays."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import LinearCostModel

from scheduler import SchedulerConfig
from scheduler.buckets import query_bucket
from scheduler.budget import choose_row_budget
from scheduler.cost_models import PrefillChunk, StepShape

LANES = 8


def _config(checked: str, **overrides) -> SchedulerConfig:
    fields = {"num_blocks": 4096, "row_quantum": 64, "kv_bucket": 1024, "floor_slack": 1.0, "checked_fill": checked,
              "plan_headroom": 1.0}
    return SchedulerConfig(**(fields | overrides))


def _decide(checked: str, model, target_ms: float, prompt_rows: int = 16_000, traced=None, **overrides):
    demand = [PrefillChunk(rows=prompt_rows, history=4096)]
    return choose_row_budget(_config(checked, **overrides), model, demand, LANES, False, True, target_ms, traced)


@pytest.mark.parametrize(
    "target_ms,unchecked,checked",
    [
        # 22 ms + 0.02 a row: 256 rows 27.1 ms, 384 rows 29.7, 512 rows 32.2, 768 rows 37.4
        (35.0, (768, "halved:2"), (512, "halved:2+bucket")),  # the fill to 768 is over the target: held at 512
        (38.0, (768, "halved:2"), (768, "halved:2")),  # 768 fits: the fill is kept either way
        (29.0, (384, "halved:3"), (256, "halved:3+bucket")),
        (30.0, (384, "halved:3"), (384, "halved:3")),
    ],
)
def test_a_fill_past_the_bucket_is_kept_only_where_it_fits(target_ms, unchecked, checked):
    for mode, expected in (("off", unchecked), ("on", checked)):
        decision = _decide(mode, LinearCostModel(), target_ms)
        assert (decision.row_budget, decision.reason) == expected, f"checked_fill={mode}"


def test_a_held_fill_still_fills_its_tile_within_the_bucket():
    """A budget that is not a bucket (a 1,000-row ceiling halved twice: 250) is held at its bucket (256), not at
    250: those rows run as padding anyway. 22 ms + 0.02 a row against 28 ms: 250 rows fit, 384 do not."""
    decision = _decide("on", LinearCostModel(), 28.0, row_ceiling=1000)
    assert (decision.row_budget, decision.reason) == (256, "halved:2+bucket")
    assert _decide("off", LinearCostModel(), 28.0, row_ceiling=1000).row_budget == 384


@settings(max_examples=300, deadline=None)
@given(
    fixed_ms=st.floats(1.0, 40.0),
    row_ms=st.floats(0.001, 0.1),
    target_ms=st.floats(5.0, 80.0),
    prompt_rows=st.integers(1, 5000),
    row_floor=st.sampled_from([16, 64, 128]),
    midpoints=st.booleans(),
)
def test_checking_the_fill_holds_only_steps_predicted_over_the_target(
    fixed_ms, row_ms, target_ms, prompt_rows, row_floor, midpoints
):
    """Against the unchecked decision: the checked budget is never larger; where they differ, the unchecked step was
    predicted over the target and the checked one crossed no bucket to get there; where they agree nothing was held."""
    model = LinearCostModel(fixed_ms=fixed_ms, row_ms=row_ms)
    extra = {"row_floor": row_floor, "budget_midpoints": midpoints}
    unchecked = _decide("off", model, target_ms, prompt_rows, **extra)
    checked = _decide("on", model, target_ms, prompt_rows, **extra)
    assert checked.row_budget <= unchecked.row_budget
    if checked.row_budget == unchecked.row_budget:
        assert checked.reason == unchecked.reason
        return
    assert "+bucket" in checked.reason
    demand = PrefillChunk(rows=min(prompt_rows, unchecked.row_budget), history=4096)
    assert model.predict(StepShape((demand,), LANES)) > target_ms
    assert checked.row_budget < query_bucket(unchecked.row_budget)


class CompiledDiscount(LinearCostModel):
    """22 ms + 0.02 a row, 8 ms less for a step that replays a compiled trace."""

    def predict(self, shape: StepShape) -> float:
        return super().predict(shape) - (8.0 if shape.compiled else 0.0)


@pytest.mark.parametrize(
    "traced_rows,expected",
    [
        # 512 rows replay a trace (24.2 ms), 768 would run eager (37.4 ms) against 35: held at 512
        ((512,), (512, "halved:2+bucket")),
        # 768 rows replay one too (29.4 ms): within the target, kept
        ((512, 768), (768, "halved:2")),
        # neither is traced: the fill loses no trace, so it is kept over the target, as with "off"
        ((), (768, "halved:2")),
    ],
)
def test_untraced_holds_a_fill_only_where_it_would_lose_its_trace(traced_rows, expected):
    def traced(chunks) -> bool:
        return sum(chunk.rows for chunk in chunks) in traced_rows

    decision = _decide("untraced", CompiledDiscount(), 35.0, traced=traced)
    assert (decision.row_budget, decision.reason) == expected


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="checked_fill"):
        _config("always")

