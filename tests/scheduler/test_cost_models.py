"""Cost models: the bucketed table's training rules and its exact fallback to the EMA baseline."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from scheduler.affine_cost import FEATURES, MIN_SAMPLES, AffineCostModel, features
from scheduler.buckets import query_bucket
from scheduler.cost_models import (
    NUM_CELLS,
    BucketedCostModel,
    EmaCostModel,
    PrefillChunk,
    StepShape,
    cell_index,
    make_cost_model,
)
from scheduler.plan import Path

chunks = st.lists(
    st.builds(PrefillChunk, rows=st.integers(1, 2048), history=st.integers(0, 40_000)), min_size=1, max_size=6
)
shapes = st.builds(
    StepShape, chunks=chunks.map(tuple), decode_lanes=st.integers(0, 64), path=st.sampled_from([Path.GPU, Path.ANE])
)
times = st.one_of(st.floats(0.5, 5000.0), st.sampled_from([0.0, -1.0, math.inf, -math.inf, math.nan]))


def snapshot(model: BucketedCostModel) -> tuple:
    return (list(model.ms_per_row), list(model.samples), model.baseline.ms_per_row, model.baseline.samples)


def test_ninety_six_cells_and_distinct_indices() -> None:
    assert NUM_CELLS == 96
    seen = set()
    for rows in (64, 256, 1024):
        for history in (0, 1024, 4096, 16384):
            for width in (1, 2, 3, 5):
                for path in (Path.GPU, Path.ANE):
                    chunk_rows = -(-rows // width)
                    shape = StepShape(tuple(PrefillChunk(chunk_rows, history) for _ in range(width)), 0, path)
                    seen.add(cell_index(shape))
    assert seen == set(range(96))


@settings(max_examples=150, deadline=None)
@given(observations=st.lists(st.tuples(shapes, times), max_size=40), queries=st.lists(shapes, min_size=1, max_size=5))
def test_untrained_cells_predict_exactly_the_ema(observations, queries) -> None:
    ema, bucketed = EmaCostModel(), BucketedCostModel()
    for shape, elapsed in observations:
        ema.observe(shape, elapsed)
        bucketed.observe(shape, elapsed)
    for shape in queries:
        if bucketed.samples[cell_index(shape)] < 3:
            assert bucketed.predict(shape) == ema.predict(shape)


@settings(max_examples=150, deadline=None)
@given(shape=shapes, elapsed=times, auxiliary=st.booleans(), warmup=st.lists(st.tuples(shapes, times), max_size=10))
def test_untrainable_observations_change_nothing(shape, elapsed, auxiliary, warmup) -> None:
    model = BucketedCostModel()
    for warm_shape, warm_elapsed in warmup:
        model.observe(warm_shape, warm_elapsed)
    shape = StepShape(shape.chunks, shape.decode_lanes, shape.path, auxiliary)
    trainable = not auxiliary and shape.prefill_rows >= 64 and math.isfinite(elapsed) and elapsed > 0
    before = snapshot(model)
    model.observe(shape, elapsed)
    assert (snapshot(model) == before) == (not trainable)


def test_a_cell_is_used_from_its_third_sample_with_ewma_quarter_weight() -> None:
    model = BucketedCostModel()
    shape = StepShape((PrefillChunk(512, 0),), 4)
    other = StepShape((PrefillChunk(1500, 20_000),), 4)
    model.observe(other, 1500.0)  # baseline: 1 ms/row
    for elapsed in (512.0, 1024.0):  # cell samples 1 and 2 (2 ms/row): still the baseline
        model.observe(shape, elapsed)
        assert model.predict(shape) == model.baseline.predict(shape)
    model.observe(shape, 2048.0)
    expected = 1.0 + 0.25 * (2.0 - 1.0)  # first sample sets the cell, then EWMA 0.25
    expected = expected + 0.25 * (4.0 - expected)
    assert model.predict(shape) == pytest.approx(expected * 512)


@settings(max_examples=100, deadline=None)
@given(observations=st.lists(st.tuples(shapes, st.floats(1.0, 5000.0)), max_size=40))
def test_paths_never_cross_train_and_memory_is_fixed(observations) -> None:
    model = BucketedCostModel()
    size = model.memory_bytes()
    for shape, elapsed in observations:
        model.observe(StepShape(shape.chunks, shape.decode_lanes, Path.GPU), elapsed)
    ane_cells = [i for i in range(NUM_CELLS) if i % 2 == 1]
    assert all(model.samples[i] == 0 for i in ane_cells)
    assert model.memory_bytes() == size <= 1536


def test_row_weighted_history_sees_a_non_leading_long_lane() -> None:
    shape = StepShape((PrefillChunk(100, 0), PrefillChunk(1948, 16_000)))
    assert shape.weighted_history == pytest.approx(1948 * 16_000 / 2048)
    assert cell_index(shape) != cell_index(StepShape((PrefillChunk(100, 0), PrefillChunk(1948, 0))))


def test_affine_recovers_a_linear_cost_and_falls_back_before() -> None:
    model = AffineCostModel()
    probe = StepShape((PrefillChunk(500, 3000),), 4)
    for index in range(40):
        shape = StepShape((PrefillChunk(64 + 37 * index, 100 * index),), index % 8)
        if index < 8:
            assert model.predict(probe) == model.baseline.predict(probe)
        model.observe(shape, 5 + 0.05 * shape.prefill_rows + 2e-5 * shape.attention_pairs + 0.3 * shape.decode_lanes)
    expected = 5 + 0.05 * 500 + 2e-5 * probe.attention_pairs + 0.3 * 4
    assert model.predict(probe) == pytest.approx(expected, rel=1e-3)


def test_affine_bounds_a_stall_and_still_learns_a_lasting_change() -> None:
    """One step that stalled (a first-use compile) moves the fit a bounded way; a cost that doubles for good is
    learned about as the unbounded fit learns it (a sample is bounded only while the fit is off by 3x)."""

    def cost(shape: StepShape, scale: float = 1.0) -> float:
        return scale * (5 + 0.05 * shape.prefill_rows + 2e-5 * shape.attention_pairs + 0.3 * shape.decode_lanes)

    def trained(fit: AffineCostModel, steps: range, scale: float = 1.0, bounded: bool = True) -> None:
        for index in steps:
            shape = StepShape((PrefillChunk(64 + 37 * (index % 40), 100 * (index % 50)),), index % 8)
            if bounded:
                fit.observe(shape, cost(shape, scale))
            else:
                fit.fits[Path.GPU].observe(features(shape), cost(shape, scale))

    probe = StepShape((PrefillChunk(500, 3000),), 4)
    stall = StepShape((PrefillChunk(2048, 0), PrefillChunk(512, 0)), 0)
    model, unbounded = AffineCostModel(), AffineCostModel()
    trained(model, range(60))
    trained(unbounded, range(60), bounded=False)
    model.observe(stall, 10_000.0)
    unbounded.fits[Path.GPU].observe(features(stall), 10_000.0)
    # within 3x of the fit's prediction or the ema baseline's, whichever allows more (here the baseline's)
    assert model.predict(stall) <= 4 * cost(stall) < unbounded.predict(stall) / 10
    assert model.predict(probe) == pytest.approx(cost(probe), rel=0.25)

    honest, plain = AffineCostModel(), AffineCostModel()
    for fit, bounded in ((honest, True), (plain, False)):
        trained(fit, range(60), bounded=bounded)
        trained(fit, range(60, 120), scale=2.0, bounded=bounded)
    want = cost(probe, 2.0)
    assert abs(honest.predict(probe) - want) <= abs(plain.predict(probe) - want) + 0.1 * want


def test_env_overrides_the_configured_model(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SchedulerConfig(num_blocks=8)
    assert config.resolved_cost_model({}) == "ema"
    assert config.resolved_cost_model({"MLX_SERVE_PREFILL_COST_MODEL": "bucketed"}) == "bucketed"
    with pytest.raises(ValueError):
        config.resolved_cost_model({"MLX_SERVE_PREFILL_COST_MODEL": "oracle"})
    monkeypatch.setenv("MLX_SERVE_PREFILL_COST_MODEL", "affine")
    from scheduler import Scheduler

    assert Scheduler(config).cost_model.name == "affine"
    assert {make_cost_model(name).name for name in ("ema", "bucketed", "affine")} == {"ema", "bucketed", "affine"}


def padded_cost(shape: StepShape) -> float:
    """A step's time as the engine runs it with 1,024-token KV buckets: padded rows, the padded rectangle."""
    from scheduler.buckets import history_bucket, query_bucket

    rows = sum(query_bucket(c.rows) for c in shape.chunks)
    pairs = sum(query_bucket(c.rows) * history_bucket(c.history + c.rows, 1024) for c in shape.chunks)
    return 3 + 0.004 * rows + 6e-7 * pairs + 0.2 * shape.decode_lanes + 4.0 * (shape.width - 1)


def test_affine_counts_the_padded_work_where_the_engine_pads() -> None:
    """Trained on steps timed as padded shapes, the padded fit predicts a 16k prompt's 1,552-row last chunk as the
    2,048 rows it runs as, and a chunk just past a KV bucket edge at the next bucket's cost; the exact fit cannot."""
    padded, exact = AffineCostModel(kv_bucket=1024), AffineCostModel()
    for index in range(300):
        rows = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)[index % 11]
        shape = StepShape((PrefillChunk(rows, (index * 977) % 15_000),), 8)
        padded.observe(shape, padded_cost(shape))
        exact.observe(shape, padded_cost(shape))
    last = StepShape((PrefillChunk(1552, 14_832),), 8)
    assert padded.predict(last) == pytest.approx(padded_cost(last), rel=0.02)
    assert padded.predict(last) > 1.2 * padded.predict(StepShape((PrefillChunk(1536, 14_832),), 8))
    assert abs(exact.predict(last) - padded_cost(last)) > 0.05 * padded_cost(last)
    edge = StepShape((PrefillChunk(1024, 11_300),), 8)  # ends at 12,324: a 16k bucket, not 12k
    assert padded.predict(edge) == pytest.approx(padded_cost(edge), rel=0.02)
    assert features(StepShape((PrefillChunk(100, 0),), 0, Path.ANE), 1024)[1] == 0.1  # the ANE lane runs exact


def test_affine_counts_rows_padded_but_history_exact_where_the_attention_reads_the_pool() -> None:
    """With the paged chunk kernel the engine still pads a chunk's rows to a query bucket, but its attention reads
    only the KV each row sees: pairs are the padded rows times the exact history (plus half the chunk), so a chunk
    just past a history bucket's edge costs what its neighbour does, not a bucket more."""
    chunk = PrefillChunk(100, 12_300)  # ends at 12,400: history bucket 16,384
    shape = StepShape((chunk,), 8)
    assert features(shape, 1024)[2] == pytest.approx(128 * 16_384 * 1e-6)
    assert features(shape, 1024, pads_history=False)[2] == pytest.approx(128 * (12_400 - 50) * 1e-6)
    assert features(shape, 1024, pads_history=False)[1] == features(shape, 1024)[1] == pytest.approx(0.128)
    exact = AffineCostModel(kv_bucket=1024, pads_history=False)

    def cost(s: StepShape) -> float:  # what such a kernel costs: linear in the exact pairs
        return 3 + 0.004 * sum(query_bucket(c.rows) for c in s.chunks) + 6e-7 * sum(
            query_bucket(c.rows) * (c.history + c.rows / 2) for c in s.chunks)  # fmt: skip

    for index in range(200):
        rows = (64, 128, 256, 512, 1024)[index % 5]
        trained = StepShape((PrefillChunk(rows, (index * 977) % 15_000),), 8)
        exact.observe(trained, cost(trained))
    edge = StepShape((PrefillChunk(1024, 11_300),), 8)
    assert exact.predict(edge) == pytest.approx(cost(edge), rel=0.02)


def test_affine_learns_extra_lanes_after_thousands_of_steps_without_any() -> None:
    """Thousands of one-chunk steps leave the width direction unexcited: its coefficient stays 0 and the rest
    finite, and a few multi-prompt steps then teach what extra lanes cost."""
    model = AffineCostModel(kv_bucket=1024)
    for index in range(5000):
        shape = StepShape((PrefillChunk((256, 512, 768, 1024)[index % 4], (index * 331) % 12_000),), index % 9)
        model.observe(shape, padded_cost(shape))
    fit = model.fits[Path.GPU]
    assert len(fit.theta) == FEATURES and all(map(math.isfinite, fit.theta)) and fit.theta[4] == 0.0
    start_up = StepShape(tuple(PrefillChunk(480, 26) for _ in range(4)), 4)
    before = abs(model.predict(start_up) - padded_cost(start_up))
    for index in range(6):
        burst = StepShape(tuple(PrefillChunk(256 + 64 * index, 0) for _ in range(2 + index % 3)), 4)
        model.observe(burst, padded_cost(burst))
    after = abs(model.predict(start_up) - padded_cost(start_up))
    assert before > 0.2 * padded_cost(start_up) and after < 0.05 * padded_cost(start_up)


def test_affine_bounds_a_stall_among_its_first_steps_by_the_baseline() -> None:
    """First-use kernel builds among the first few steps (H200, 4-bit: 2 s for a 128-row step of ~20 ms) are
    bounded by the ema baseline before the fit answers: once it answers, its predictions of the next steps are off
    by under 75% on average (the two bounded stalls are still a quarter of its samples), where a fit trained on the
    raw times was off by more than 2x."""

    def cost(shape: StepShape) -> float:
        return 8.0 + 0.05 * shape.prefill_rows

    steps = [StepShape((PrefillChunk((128, 256, 384)[i % 3], 512 * i),), 8) for i in range(20)]
    bounded, raw = AffineCostModel(), AffineCostModel()
    errors: dict[str, list[float]] = {"bounded": [], "raw": []}
    for index, shape in enumerate(steps):
        elapsed = 2000.0 if index in (2, 4) else cost(shape)
        if index >= MIN_SAMPLES:
            errors["bounded"].append(abs(bounded.predict(shape) / cost(shape) - 1))
            errors["raw"].append(abs(raw.predict(shape) / cost(shape) - 1))
        bounded.observe(shape, elapsed)
        if index < MIN_SAMPLES:  # the old rule: nothing bounded before the fit answers
            raw.baseline.observe(shape, elapsed)
            raw.fits[Path.GPU].observe(features(shape), elapsed)
        else:
            raw.observe(shape, elapsed)
    assert sum(errors["bounded"]) / len(errors["bounded"]) < 0.75
    assert sum(errors["raw"]) / len(errors["raw"]) > 2.0


samples = st.lists(
    st.tuples(st.tuples(st.just(1.0), *[st.floats(0.0, 8.0) for _ in range(FEATURES - 1)]), st.floats(-50.0, 200.0)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(observed=samples, probes=st.lists(st.lists(st.floats(-3.0, 3.0), min_size=FEATURES, max_size=FEATURES), max_size=8))
def test_the_signed_fit_is_the_least_squares_optimum_within_its_signs(observed, probes) -> None:
    """Whatever it is shown (noisy, negative times included), `SignedLeastSquares` keeps every coefficient to its
    sign, and no other coefficients with those signs fit the forgotten samples better (the constrained optimum)."""
    from scheduler.affine_cost import RIDGE, SIGNS, SignedLeastSquares

    fit = SignedLeastSquares(SIGNS)
    for x, y in observed:
        fit.observe(x, y)
    theta = fit.theta
    assert all(sign * t >= 0 for sign, t in zip(SIGNS, theta, strict=True))

    def loss(coefficients: list[float]) -> float:  # what the fit minimises: forgotten squared error + the ridge
        n = len(observed)
        error = sum(fit.forgetting ** (n - 1 - i) * (y - sum(c * v for c, v in zip(coefficients, x))) ** 2
                    for i, (x, y) in enumerate(observed))  # fmt: skip
        return error + RIDGE * sum(c * c for c in coefficients)

    best = loss(theta)
    for step in probes:  # feasible points near the optimum are never better
        other = [t + s for t, s in zip(theta, step, strict=True)]
        other = [max(o, 0.0) if sign > 0 else min(o, 0.0) if sign < 0 else o for sign, o in zip(SIGNS, other, strict=True)]
        assert loss(other) >= best - 1e-6 * (1.0 + best)
