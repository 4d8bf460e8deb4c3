"""The floor slack where the floor step is priced far over the target (`SLACK_WITHIN`): there the fit is more likely
wrong and the target holds, unless steps doing no more work than the floor step were measured over the planned
target. Then the price is no guess: the fixed cost fills the target at any rows, and halving to the floor only reads
the prompt at its slowest (H100, 8B 4-bit, the sixty-first and sixty-second runs' first warm passes: 78-98 eager
64-row steps of 19-36 ms, each over the target)."""

from __future__ import annotations

import pytest
from scheduler_helpers import LinearCostModel

from scheduler import SchedulerConfig
from scheduler.affine_cost import AffineCostModel
from scheduler.budget import SLACK_WITHIN, choose_row_budget, slack_allowance_ms
from scheduler.cost_models import BucketedCostModel, EmaCostModel, PrefillChunk, StepShape

LANES = 8
DEMAND = [PrefillChunk(rows=8_000, history=8_192)]
TARGET_MS = 20.0  # planned at 0.9: 18 ms, and the floor is doubted past 1.5 x that, 27 ms


class MeasuredFloor(LinearCostModel):
    """A step of 28 ms + 0.02 ms a row (the floor's 128 filled rows: 30.6 ms, past 27), whose floor-sized steps were
    measured at `measured_ms` (None: none remembered)."""

    def __init__(self, measured_ms: float | None) -> None:
        super().__init__(fixed_ms=28.0, row_ms=0.02)
        self.measured_ms = measured_ms
        self.asked: list[StepShape] = []

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        self.asked.append(shape)
        return self.measured_ms


def _config() -> SchedulerConfig:
    return SchedulerConfig(num_blocks=4096, plan_headroom=0.9, kv_bucket=1024, row_quantum=64, floor_slack=2.0)


def test_a_floor_priced_far_over_the_target_gives_no_slack_unless_measured_so():
    config = _config()
    floor_ms = 28.0 + 0.02 * 128
    assert floor_ms > SLACK_WITHIN * TARGET_MS * 0.9
    for unmeasured in (MeasuredFloor(None), MeasuredFloor(15.0), MeasuredFloor(TARGET_MS * 0.9)):
        assert slack_allowance_ms(config, unmeasured, DEMAND, LANES, TARGET_MS) == TARGET_MS
    measured = MeasuredFloor(29.0)
    allowance = slack_allowance_ms(config, measured, DEMAND, LANES, TARGET_MS)
    guard_ms = 28.0 + 0.02 * 512  # the slack guard's 512-row step caps 2 x the floor (61.1 ms)
    assert allowance == pytest.approx(guard_ms / 0.9)
    # asked about the floor step as it would run at the prompt's history: 64 rows filled to 128, beside the lanes
    (shape,) = measured.asked
    assert (shape.prefill_rows, shape.decode_lanes, shape.chunks[0].history, shape.compiled) == (128, LANES, 8_192, False)


def test_a_measured_floor_lets_the_budget_leave_the_floor():
    config = _config()
    doubted = choose_row_budget(config, MeasuredFloor(None), DEMAND, LANES, False, True, TARGET_MS)
    assert (doubted.row_budget, doubted.reason) == (64, "halved:5+bucket")  # the floor, over the target
    measured = choose_row_budget(config, MeasuredFloor(29.0), DEMAND, LANES, False, True, TARGET_MS)
    assert measured.reason.endswith("+slack") and measured.row_budget == 512
    assert measured.predicted_ms <= measured.limit_ms


def test_a_floor_within_slack_within_needs_no_measurement():
    """Where the floor's price is plausible the slack applies as before, measured or not."""
    config = _config()
    cheaper = MeasuredFloor(None)
    cheaper.fixed_ms = 22.0  # the floor 24.6 ms: within 27
    assert slack_allowance_ms(config, cheaper, DEMAND, LANES, TARGET_MS) > TARGET_MS
    assert cheaper.asked == []


def _affine_with_floor_steps(ms: float, compiled: bool = False) -> AffineCostModel:
    """A fit taught a solo prefill (4 steps of 2,040 rows, 73 ms: 2.3 ms for 64 rows), then 24 floor steps."""
    model = AffineCostModel(kv_bucket=1024)
    for history in range(0, 8_160, 2_040):
        model.observe(StepShape((PrefillChunk(2_040, history),)), 73.0)
    for history in range(8_192, 8_192 + 64 * 24, 64):
        model.observe(StepShape((PrefillChunk(64, history),), LANES, compiled=compiled), ms)
    return model


def test_the_affine_model_measures_the_floor_from_the_steps_it_remembers():
    floor = StepShape((PrefillChunk(128, 9_800),), LANES)
    assert AffineCostModel(kv_bucket=1024).measured_floor_ms(floor) is None  # nothing remembered
    model = _affine_with_floor_steps(30.0)
    # the first steps a fresh fit trains on are bounded far under their time (it had seen none): the median is not
    assert model.trust[floor.path].floor_ms(128, 9_928, LANES, False, 1) < 15.0
    assert model.measured_floor_ms(floor) == pytest.approx(30.0)
    # no step did as little work: fewer decode lanes, or a shorter reach, than every remembered step
    for smaller in (StepShape((PrefillChunk(128, 9_800),), 4), StepShape((PrefillChunk(128, 4_000),), LANES)):
        assert model.measured_floor_ms(smaller) is None
    # an eager step is compared with steps of either form, a compiled one with compiled steps only
    assert model.measured_floor_ms(StepShape((PrefillChunk(128, 9_800),), LANES, compiled=True)) is None
    compiled = _affine_with_floor_steps(15.0, compiled=True)
    assert compiled.measured_floor_ms(floor) == pytest.approx(15.0)


def test_models_that_remember_no_step_measure_no_floor():
    shape = StepShape((PrefillChunk(128, 0),), LANES)
    for model in (EmaCostModel(), BucketedCostModel()):
        model.observe(StepShape((PrefillChunk(128, 0),), LANES), 30.0)
        assert model.measured_floor_ms(shape) is None
