"""Compiled and eager steps: the affine model prices the two forms apart, a budget is predicted in the form its
step would run now, and a larger budget turned down only for want of a trace is asked for (`TracedShapes.want`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from scheduler_helpers import fake_outcome, make_request, run_step

from scheduler import Lane, Scheduler, SchedulerConfig
from scheduler.affine_cost import AffineCostModel, features
from scheduler.cost_models import PrefillChunk, StepShape


def eager_ms(shape: StepShape) -> float:
    return 10.0 + 0.008 * shape.prefill_rows  # a host-bound eager step: a large fixed cost


def compiled_ms(shape: StepShape) -> float:
    return 1.0 + 0.008 * shape.prefill_rows  # the same GPU work replayed from a trace


def trained(model: AffineCostModel, compiled: bool, steps: int = 60) -> None:
    for index in range(steps):
        shape = StepShape((PrefillChunk((128, 256, 512, 1024)[index % 4], 0),), 8, compiled=compiled)
        model.observe(shape, compiled_ms(shape) if compiled else eager_ms(shape))


def test_the_affine_model_prices_a_compiled_step_at_a_fixed_saving() -> None:
    """The forms share the slopes: compiled steps of one size (64 rows, as a run stuck at small budgets meets them)
    teach the saving, and a compiled 768-row step is priced right without ever running; before any compiled step,
    a compiled one is priced as eager."""
    model = AffineCostModel()
    trained(model, compiled=False)
    step = StepShape((PrefillChunk(768, 0),), 8)
    as_compiled = StepShape((PrefillChunk(768, 0),), 8, compiled=True)
    assert model.predict(step) == pytest.approx(eager_ms(step), rel=0.01)
    assert model.predict(as_compiled) == pytest.approx(model.predict(step))
    for _ in range(30):
        small = StepShape((PrefillChunk(64, 0),), 8, compiled=True)
        model.observe(small, compiled_ms(small))
    assert model.predict(as_compiled) == pytest.approx(compiled_ms(as_compiled), rel=0.02)
    assert model.predict(step) == pytest.approx(eager_ms(step), rel=0.02)
    assert features(as_compiled)[-1] == 1.0 and features(step)[-1] == 0.0


class FakeTraces:
    """Traces of some chunk sizes (any history, any decode lanes); records what the scheduler asks for."""

    def __init__(self, rows: set[int]) -> None:
        self.rows = rows
        self.wanted: list[tuple[tuple[PrefillChunk, ...], int]] = []

    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.rows

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> None:
        self.wanted.append((tuple(chunks), len(decode)))


def plan_beside_streams(traces: FakeTraces | None) -> tuple[Scheduler, object]:
    """8 streams decoding, a 4,000-token prompt arrives; a 14 ms target; eager and compiled fits trained."""
    config = SchedulerConfig(num_blocks=4096, cost_model="affine", step_target_ms=14.0)
    scheduler = Scheduler(config, traced_shapes=traces)
    trained(scheduler.cost_model, compiled=False)
    trained(scheduler.cost_model, compiled=True)
    for index in range(8):
        scheduler.add(make_request(f"stream{index}", 4, max_tokens=500, base=1000 * (index + 1)))
    run_step(scheduler, 0.0, elapsed_ms=5.0)
    scheduler.add(make_request("long", 4000, max_tokens=1, base=900_000))
    return scheduler, scheduler.schedule(0.01)


def test_a_budget_is_predicted_in_the_form_its_step_runs_and_wants_the_trace_it_lacks() -> None:
    # nothing traced: 1,024 rows would take 9.2 ms compiled but 18.2 eager; 512 eager is 14.1, over; 256 + a half
    # is 13.1. The 1,024-row chunk is wanted (2,048 compiled, 17.4 ms, would not fit either way)
    traces = FakeTraces(set())
    scheduler, plan = plan_beside_streams(traces)
    assert plan.prefill_rows == 384 and plan.predicted_ms == pytest.approx(10 + 0.008 * 384, rel=0.01)
    assert traces.wanted == [((PrefillChunk(1024, 0),), 8)]
    assert scheduler.stats.traces_wanted == 1
    # with the 1,024-row shape traced the step takes it, predicted as compiled; its midpoint, 1,536 rows, would fit
    # compiled too (13.3 ms) and is wanted; with both traced the step takes 1,536 and wants nothing
    traces = FakeTraces({1024})
    scheduler, plan = plan_beside_streams(traces)
    assert plan.prefill_rows == 1024 and plan.predicted_ms == pytest.approx(1 + 0.008 * 1024, rel=0.01)
    assert traces.wanted == [((PrefillChunk(1536, 0),), 8)]
    traces = FakeTraces({1024, 1536})
    scheduler, plan = plan_beside_streams(traces)
    assert plan.prefill_rows == 1536 and not traces.wanted and scheduler.stats.traces_wanted == 0
    # an engine that compiles no prefill: one form, as before (the compiled fit is never asked for)
    scheduler, plan = plan_beside_streams(None)
    assert plan.prefill_rows == 384


class Spy:
    """A cost model that records the form of every step it is taught."""

    name = "spy"

    def __init__(self, model: AffineCostModel) -> None:
        self.model = model
        self.taught: list[bool] = []

    def predict(self, shape: StepShape) -> float | None:
        return self.model.predict(shape)

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        self.taught.append(shape.compiled)
        self.model.observe(shape, elapsed_ms)


def test_a_step_is_taught_in_the_form_it_ran_in() -> None:
    """The form comes from the runner's outcome (`StepOutcome.compiled`), not from what the plan expected."""
    scheduler, plan = plan_beside_streams(FakeTraces({1024}))
    spy = scheduler.cost_model = Spy(scheduler.cost_model)
    scheduler.update(plan, fake_outcome(plan, 9.0, compiled=True), 0.011)  # times kept clear of decode debt
    plan = scheduler.schedule(0.012)
    assert plan.prefill_rows
    scheduler.update(plan, fake_outcome(plan, 20.0), 0.013)
    assert spy.taught == [True, False]
