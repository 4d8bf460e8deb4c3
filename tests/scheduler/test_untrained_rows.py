"""`untrained_rows`: a contended step the cost model cannot price yet takes at most that many prefill rows. A fresh
engine's first mixed steps are each a shape's first run, which trains nothing, so before it every budget stayed at
the ceiling: four 2,040-row steps of 68-132 ms beside 25-30 ms decode steps (H100, sixty-third run)."""

from __future__ import annotations

import pytest
from scheduler_helpers import LinearCostModel

from scheduler import SchedulerConfig
from scheduler.budget import choose_row_budget
from scheduler.cost_models import MIN_TRAINING_ROWS, EmaCostModel, PrefillChunk

LANES = 8
DEMAND = [PrefillChunk(rows=16_384, history=0)]


def _budget(config: SchedulerConfig, model, contended: bool = True, in_debt: bool = False):
    return choose_row_budget(config, model, DEMAND, LANES, in_debt=in_debt, contended=contended, target_ms=20.0)


@pytest.mark.parametrize("untrained_rows, rows", [(0, 2048), (512, 512), (16, 64), (4096, 2048)])  # 64: floor, training
def test_an_unpriced_contended_step_takes_at_most_untrained_rows(untrained_rows, rows):
    decision = _budget(SchedulerConfig(num_blocks=4096, untrained_rows=untrained_rows), EmaCostModel())
    assert decision.predicted_ms is None and decision.reason == "contended-untrained"
    assert decision.row_budget == rows  # 0: the ceiling; never under the floor nor over the ceiling


def test_the_cap_never_goes_under_the_rows_a_step_trains_on():
    """A cap under `MIN_TRAINING_ROWS` would train nothing and hold for ever: it stops there."""
    config = SchedulerConfig(num_blocks=4096, row_floor=8, untrained_rows=16)
    assert _budget(config, EmaCostModel()).row_budget == MIN_TRAINING_ROWS


def test_a_priced_step_and_an_uncontended_one_are_not_capped():
    config = SchedulerConfig(num_blocks=4096, untrained_rows=512)
    cheap = LinearCostModel(fixed_ms=1.0, row_ms=0.001)  # 2,048 rows fit the target: the price decides, not the cap
    assert _budget(config, cheap).row_budget == 2048
    assert _budget(config, EmaCostModel(), contended=False).row_budget == 2048
    assert _budget(config, EmaCostModel(), in_debt=True).row_budget == 0


def test_untrained_rows_is_a_count():
    with pytest.raises(ValueError, match="untrained_rows"):
        SchedulerConfig(num_blocks=16, untrained_rows=-1)
