"""The affine model's per-cell correction (`cost_residual_weight`): a price moved by what the fit recently missed by
on steps of the same rows bucket, so a size the GPU runs at another rate than the fit's one rows slope is priced as
it runs (H100, 8B 4-bit: 512 rows beside 8 decode lanes ran in about a 384-row step's time)."""

from __future__ import annotations

import pytest

from scheduler import SchedulerConfig
from scheduler.affine_cost import RESIDUAL_BOUND, AffineCostModel
from scheduler.cost_models import PrefillChunk, StepShape, make_cost_model


def shape(rows: int, history: int = 0, lanes: int = 8) -> StepShape:
    return StepShape((PrefillChunk(rows, history),), lanes)


def tiled_ms(rows: int, history: int) -> float:
    """A step's cost where 384 and 512 rows run as one tile count: 512 costs what 384 does."""
    return 6.0 + 0.04 * min(rows, 384) + 0.04 * max(rows - 512, 0) + 1e-6 * rows * history


def trained(weight: float) -> AffineCostModel:
    model = AffineCostModel(residual_weight=weight)
    for index in range(120):
        rows = (256, 384, 512, 768)[index % 4]
        history = 512 * (index // 4)
        model.observe(shape(rows, history), tiled_ms(rows, history))
    return model


def test_a_bucket_the_fit_overprices_is_priced_near_what_it_ran() -> None:
    plain, corrected = trained(0.0), trained(0.3)
    history = 512 * 30
    step = shape(512, history)
    measured = tiled_ms(512, history)
    assert plain.predict(step) - measured > 1.0  # the one rows slope puts 512 between 384 and 768
    assert abs(corrected.predict(step) - measured) < 0.25 * (plain.predict(step) - measured)
    # each bucket keeps its own correction: 384's price stays near its own cost, not dragged down with 512's
    assert corrected.predict(shape(384, history)) == pytest.approx(tiled_ms(384, history), rel=0.05)


def test_weight_zero_is_off_and_the_fit_is_untouched() -> None:
    """Weight 0 learns nothing and prices as the plain fit; the correction never trains the fit. On by default
    (0.3: the H100's sixty-first run)."""
    assert SchedulerConfig(num_blocks=8).cost_residual_weight == 0.3
    off, on = trained(0.0), trained(0.3)
    assert not off.residuals.offsets
    assert off.fits[shape(1).path].theta == pytest.approx(on.fits[shape(1).path].theta)
    assert make_cost_model("affine", residual_weight=0.3).residuals.weight == 0.3
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="cost_residual_weight"):
            SchedulerConfig(num_blocks=8, cost_residual_weight=bad)


def test_a_wild_sample_moves_the_price_at_most_the_bound() -> None:
    """A stalled step (ten times its price) moves its cell's correction by at most weight x bound x price, and
    however many follow, the correction stays within the bound (the fit, trained on it within its own outlier
    bound, moves apart)."""
    model = trained(0.3)
    step = shape(512, 512 * 30)
    cell = next(c for c in model.residuals.offsets if c[1] == 512)
    before, price = model.residuals.offsets[cell], model._fitted(step)
    model.observe(step, 10 * model.predict(step))
    assert model.residuals.offsets[cell] - before == pytest.approx(0.3 * (RESIDUAL_BOUND * price - before))
    for _ in range(50):
        model.observe(step, 10 * model.predict(step))
        fitted = model._fitted(step)
        assert fitted < model.predict(step) <= (1 + RESIDUAL_BOUND) * fitted + 1e-9


def test_the_cells_part_decode_lanes_forms_and_widths() -> None:
    """A correction learned beside decode lanes does not price a solo step, a compiled step or a two-chunk step."""
    model = trained(0.3)
    cells = set(model.residuals.offsets)
    assert {cell[1] for cell in cells} == {256, 384, 512, 768}
    assert all(cell[3] and not cell[4] and cell[2] == 1 for cell in cells)  # decode lanes, eager, one chunk
    solo = shape(512, 512 * 30, lanes=0)
    assert model.residuals.corrected(solo, 10.0) == 10.0
