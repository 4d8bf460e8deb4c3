"""The affine model's trust region: a fit is believed up to `trust_factor` times the rows of its largest recent
step (at a KV reach at least as long); past it a step is priced at least at that step's cost per row."""

from __future__ import annotations

import pytest

from scheduler import SchedulerConfig
from scheduler.affine_cost import LEAST_GROWTH_ROWS, TRUST_MEMORY, AffineCostModel, TrustRegion, features
from scheduler.cost_models import PrefillChunk, StepShape, make_cost_model


def curved_ms(rows: int, history: int = 0) -> float:
    """Costs with a kink an affine fit of smaller steps cannot see: dearer per row past 1,024 rows."""
    return 4.0 + 0.006 * rows + 0.01 * max(rows - 1024, 0) + 1e-7 * rows * history


def shape(rows: int, history: int = 0) -> StepShape:
    return StepShape((PrefillChunk(rows, history),), 8)


def trained(trust_factor: float, sizes: tuple[int, ...] = (128, 256, 512, 768, 1024), history: int = 0):
    model = AffineCostModel(trust_factor=trust_factor)
    for index in range(100):
        rows = sizes[index % len(sizes)]
        model.observe(shape(rows, history), curved_ms(rows, history))
    return model


def test_a_step_far_past_the_largest_trained_one_is_priced_at_its_cost_per_row() -> None:
    """Trained up to 1,024 rows, the fit prices 2,048 well under what it costs (the extrapolation that sent the
    H200's 0.6B into 31.8 ms steps planned at 21.3); the trust region prices it at 1,024's cost per row, or more."""
    fitted, trusting = trained(trust_factor=0), trained(trust_factor=1.5)
    large = shape(2048)
    per_row = curved_ms(1024) / 1024
    assert fitted.predict(large) == pytest.approx(4.0 + 0.006 * 2048, rel=0.01)  # 16.3 ms for 26.5
    assert trusting.predict(large) == pytest.approx(2048 * per_row)  # 20.3 ms
    # inside the region (1.5 x 1,024) and below it, the fit answers as before
    for rows in (64, 512, 1536):
        assert trusting.predict(shape(rows)) == pytest.approx(fitted.predict(shape(rows)))


def test_the_reference_is_the_largest_step_at_a_reach_at_least_as_long() -> None:
    """2,048-row steps over short histories do not vouch for 2,048 rows at 12k: there, the largest step seen
    reaching that far (512 rows) is the reference. Where nothing reached as far, the largest step of all is."""
    model = AffineCostModel(trust_factor=1.5)
    for index in range(60):
        rows, history = ((2048, 0), (512, 12_000), (1024, 1000))[index % 3]
        model.observe(shape(rows, history), curved_ms(rows, history))
    region = model.trust[shape(1).path]
    assert region.least_ms(2048, 2048) is None  # a 2,048-row step reached that far
    assert region.least_ms(2048, 14_000) == pytest.approx(2048 * curved_ms(512, 12_000) / 512)
    assert region.least_ms(768, 14_000) is None  # within 1.5 x 512
    assert region.least_ms(4096, 40_000) == pytest.approx(4096 * curved_ms(512, 12_000) / 512)
    assert region.least_ms(4096, 2048) == pytest.approx(4096 * curved_ms(2048) / 2048)


def test_the_cheapest_step_of_the_largest_size_sets_the_cost_per_row_and_old_steps_are_forgotten() -> None:
    region = TrustRegion(1.5, memory=TRUST_MEMORY)
    region.record(1024, 2048, 30.0)  # eager: host-bound
    region.record(1024, 2048, 12.0)  # the same rows replayed from a trace
    region.record(512, 2048, 4.0)
    assert region.least_ms(2048, 2048) == pytest.approx(2048 * 12.0 / 1024)
    for _ in range(TRUST_MEMORY):
        region.record(256, 2048, 4.0)
    assert region.least_ms(1024, 2048) == pytest.approx(1024 * 4.0 / 256)  # the 1,024-row steps are gone
    assert TrustRegion(0).least_ms(1 << 20, 0) is None  # off, and nothing recorded


def test_the_factor_is_configured_and_checked() -> None:
    assert make_cost_model("affine", 0, 0).trust[shape(1).path].factor == 0
    assert SchedulerConfig(num_blocks=8).cost_trust_factor == 1.5
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="cost_trust_factor"):
            SchedulerConfig(num_blocks=8, cost_trust_factor=bad)


def test_the_floor_is_the_cheapest_of_the_largest_steps_that_did_no_more_work() -> None:
    region = TrustRegion(1.5)
    region.record(1024, 2048, 12.0, lanes=8, compiled=True, exact_reach=1024)
    region.record(1024, 2048, 30.0, lanes=8, compiled=True, exact_reach=1024)  # a stall: the cheaper one counts
    region.record(512, 1024, 9.0, lanes=8, compiled=True, exact_reach=512)
    region.record(1024, 1024, 16.0, lanes=8, compiled=False, exact_reach=1024)  # eager: dearer on the host
    assert region.floor_ms(2048, 2048, 8, True, 1) == 12.0  # compiled: compiled steps only
    assert region.floor_ms(2048, 2048, 8, False, 1) == 12.0  # eager: any form (a trace is never dearer)
    assert region.floor_ms(768, 2048, 8, True, 1) == 9.0  # the 1,024-row steps did more work
    assert region.floor_ms(2048, 800, 8, True, 1) == 9.0  # ... and reached farther
    assert region.floor_ms(2048, 2048, 4, True, 1) is None  # every remembered step had more decode lanes
    assert region.floor_ms(256, 2048, 8, True, 1) is None
    assert TrustRegion(0).floor_ms(1 << 20, 1 << 20, 64, False, 8) is None  # off with the region


def test_a_fit_of_long_histories_is_floored_at_a_large_step_over_a_short_one() -> None:
    """H200, 0.6B: a fit trained on steps over long histories (their cost in the attention pairs) priced the first
    chunks of the next long prompt, 1,024-2,040 rows over no history, at 0.2-9 ms; they ran 12-37 ms, over the
    target. The same rows over no history measured before set the floor."""

    def cost(rows: int, history: int) -> float:
        return 14.0 if history == 0 else 2.0 + 0.002 * rows + 4e-7 * rows * history

    model = AffineCostModel(kv_bucket=1024, pads_history=False)
    first = StepShape((PrefillChunk(2040, 0),), 8, compiled=True)
    model.observe(first, 14.0)
    for index in range(150):
        rows, history = (384, 512, 768)[index % 3], 4096 + (index * 613) % 12_000
        model.observe(StepShape((PrefillChunk(rows, history),), 8, compiled=True), cost(rows, history))
    fitted = model.fits[first.path].predict(features(first, 1024, pads_history=False))
    assert fitted < 0.75 * 14.0  # the fit alone prices it under what it took
    assert model.predict(first) >= 14.0


def test_a_small_step_admits_the_next_shapes_beside_decode_lanes() -> None:
    """H100, 8B 4-bit (forty-sixth run): once only 64-row steps (15 ms) had reached as far as a 16k prompt's chunks,
    128 rows were priced at 64's cost a row (30 ms, over the allowance; they ran ~18 compiled), so 64-row steps read
    the rest of the prompt. Beside 8 lanes the engine's next shapes are 128 and 256 rows: the region admits them."""
    region = TrustRegion(1.5)
    for step in range(20):
        region.record(64, 8192, 15.0, lanes=8, compiled=True, exact_reach=6000 + 64 * step)
    assert LEAST_GROWTH_ROWS == 128
    assert region.least_ms(128, 8192) is None
    assert region.least_ms(192, 8192) is None
    assert region.least_ms(256, 8192) == pytest.approx(256 * 15.0 / 64)
    region.record(256, 8192, 24.0, lanes=8, compiled=True, exact_reach=8000)
    assert region.least_ms(384, 8192) is None  # 1.5 x 256 and 256 + 128 agree from here on
    assert region.least_ms(512, 8192) == pytest.approx(512 * 24.0 / 256)
