"""Compiled and eager steps: the affine model prices the two forms apart, a budget is predicted in the form its
step would run now, and a larger budget turned down only for want of a trace is asked for (`TracedShapes.want`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from scheduler_helpers import fake_outcome, make_request, run_step

from scheduler import Lane, LaneKind, Scheduler, SchedulerConfig
from scheduler.affine_cost import TRUST_FACTOR, AffineCostModel, features
from scheduler.buckets import history_bucket, query_bucket
from scheduler.budget import BudgetDecision, fill_stand_in
from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.traced_shapes import StandIn


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
    """Traces of some chunk sizes (any history, any decode lanes), and the stand-ins of others by their rows;
    records what the scheduler asks for."""

    def __init__(self, rows: set[int], stand_ins: dict[int, StandIn] | None = None,
                 replays: dict[int, float] | None = None) -> None:  # fmt: skip
        self.rows, self.stand_ins, self.replays = rows, stand_ins or {}, replays or {}
        self.wanted: list[tuple[tuple[PrefillChunk, ...], int]] = []
        self.stand_in_limits: list[float | None] = []
        self.replay_limits: set[float] = set()

    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.rows

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> None:
        self.wanted.append((tuple(chunks), len(decode)))

    def stand_in(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float | None) -> StandIn | None:
        self.stand_in_limits.append(limit_ms)
        return self.stand_ins.get(chunks[0].rows) if len(chunks) == 1 else None

    def stand_in_run_ms(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float) -> float | None:
        self.replay_limits.add(limit_ms)
        return self.replays.get(chunks[0].rows) if len(chunks) == 1 else None


def plan_beside_streams(traces: FakeTraces | None, **settings) -> tuple[Scheduler, object]:
    """8 streams decoding, a 4,000-token prompt arrives; a 14 ms target; eager and compiled fits trained."""
    # no floor slack: the budget's forms against the target alone (`test_step_target` covers the slack)
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, cost_model="affine", step_target_ms=14.0, floor_slack=1.0,
        **settings
    )
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


def test_a_step_that_would_stand_in_grows_to_the_rows_its_stand_in_carries() -> None:
    """Nothing traced, the budget is 384 eager rows (13.1 ms); where that step would replay a larger trace in its
    place (the engine says: 1,024 rows, last run 9.5 ms, within the step's limit), the step carries 1,024 rows at
    that trace's cost, predicted as its last run. Off, or where the stand-in carries no more rows, 384 stays."""
    traces = FakeTraces(set(), stand_ins={384: StandIn(1024, 9.5)})
    _, plan = plan_beside_streams(traces)
    assert (plan.prefill_rows, plan.predicted_ms) == (1024, 9.5) and plan.budget_reason.endswith("+stand-in")
    assert traces.stand_in_limits == [plan.limit_ms] and plan.limit_ms == pytest.approx(14.0)
    _, plan = plan_beside_streams(FakeTraces(set(), stand_ins={384: StandIn(1024, 9.5)}), fill_stand_ins=False)
    assert plan.prefill_rows == 384 and "+stand-in" not in plan.budget_reason
    _, plan = plan_beside_streams(FakeTraces(set(), stand_ins={384: StandIn(384, 9.5)}))
    assert plan.prefill_rows == 384 and plan.predicted_ms == pytest.approx(10 + 0.008 * 384, rel=0.01)
    # a trace not yet timed: the rows, and the budget's own prediction
    _, plan = plan_beside_streams(FakeTraces(set(), stand_ins={384: StandIn(2048, None)}))
    assert plan.prefill_rows == 2040 and plan.predicted_ms == pytest.approx(10 + 0.008 * 384, rel=0.01)  # 8 lanes


def test_a_step_that_would_replay_a_larger_trace_is_priced_at_that_traces_run() -> None:
    """Nothing traced, the budget is 384 eager rows (13.1 ms against 14). Where the engine would replay a 14.5 ms
    trace for that step (a stand-in bounded by its eager builds, not by the step's limit), `price_stand_in_runs`
    prices it so (the default) and the step takes 256 rows; off, it takes 384 priced eager. A 512-row step standing in for a 9 ms
    trace fits where its eager price (14.1) did not, and the 1,024-row candidate, over the limit as its 15 ms stand-in
    but within it compiled (9.2), is the trace wanted."""
    traces = FakeTraces(set(), replays={384: 14.5})
    _, plan = plan_beside_streams(traces, price_stand_in_runs=True)
    assert plan.prefill_rows == 256 and plan.predicted_ms == pytest.approx(10 + 0.008 * 256, rel=0.01)
    assert traces.replay_limits == {plan.limit_ms} and plan.limit_ms == pytest.approx(14.0)
    _, plan = plan_beside_streams(FakeTraces(set(), replays={384: 14.5}), price_stand_in_runs=False)
    assert plan.prefill_rows == 384 and plan.predicted_ms == pytest.approx(10 + 0.008 * 384, rel=0.01)
    traces = FakeTraces(set(), replays={512: 9.0, 1024: 15.0})
    _, plan = plan_beside_streams(traces, price_stand_in_runs=True)
    assert (plan.prefill_rows, plan.predicted_ms) == (512, 9.0)
    assert traces.wanted == [((PrefillChunk(1024, 0),), 8)]
    # where the engine counts a step that stands in as compiled (`price_stand_ins`), it is still its trace's run
    _, plan = plan_beside_streams(FakeTraces({384}, replays={384: 14.5}), price_stand_in_runs=True)
    assert plan.prefill_rows == 256


def test_a_stand_in_fill_keeps_to_one_chunk_and_its_demand() -> None:
    """`fill_stand_in`: the grown budget never reaches past the one chunk the step would carry (a second prompt's
    chunk would make the step eager), never shrinks a budget, and leaves uncontended steps alone."""
    carried = StandIn(512, 8.0)
    decision = BudgetDecision(64, "halved:5", 5, 9.7, limit_ms=11.0)
    short_first = [PrefillChunk(100, 0), PrefillChunk(5000, 0)]
    assert fill_stand_in(decision, short_first, lambda chunks: carried).row_budget == 100
    assert fill_stand_in(decision, [PrefillChunk(300, 40)], lambda chunks: carried).row_budget == 300
    grown = fill_stand_in(decision, [PrefillChunk(5000, 40)], lambda chunks: carried)
    assert (grown.row_budget, grown.reason, grown.predicted_ms, grown.limit_ms) == (512, "halved:5+stand-in", 8.0, 11.0)
    two_chunks = replace(decision, row_budget=200)
    assert fill_stand_in(two_chunks, short_first, lambda chunks: carried) == two_chunks
    uncontended = BudgetDecision(2048, "uncontended", 0, 20.0)
    assert fill_stand_in(uncontended, [PrefillChunk(5000, 0)], lambda chunks: StandIn(4096, 8.0)) == uncontended
    assert fill_stand_in(decision, [PrefillChunk(5000, 0)], lambda chunks: None) == decision


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

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        return self.model.measured_floor_ms(shape)


def test_a_step_is_taught_in_the_form_it_ran_in() -> None:
    """The form comes from the runner's outcome (`StepOutcome.compiled`), not from what the plan expected."""
    scheduler, plan = plan_beside_streams(FakeTraces({1024}))
    spy = scheduler.cost_model = Spy(scheduler.cost_model)
    scheduler.update(plan, fake_outcome(plan, 9.0, compiled=True), 0.011)  # times kept clear of decode debt
    plan = scheduler.schedule(0.012)
    assert plan.prefill_rows
    scheduler.update(plan, fake_outcome(plan, 20.0), 0.013)
    assert spy.taught == [True, False]


def h200_compiled_ms(rows: int, history: int) -> float:
    """A Qwen3-0.6B contended step beside 8 streams as call C of the twentieth H200 run timed it, compiled (1,024
    rows: 8.7 ms at a 1k KV bucket, 17.5 at 16k), padded as the engine pads."""
    padded, kv = query_bucket(rows), history_bucket(history + rows, 1024)
    return 5.0 + 0.003 * padded + 5.6e-7 * padded * kv


def h200_eager_ms(rows: int, history: int, compiled_ms: Callable[[int, int], float] = h200_compiled_ms) -> float:
    return max(9.0 + 0.004 * query_bucket(rows), compiled_ms(rows, history) + 1.0)  # host-bound when small


class BucketTraces:
    """The engine's side: a one-chunk step's shape is its (query bucket, history bucket); a shape a step ran eager,
    or the scheduler wanted, is traced when the engine is next quiet (`quiet`)."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, int]] = set()
        self.waiting: set[tuple[int, int]] = set()

    @staticmethod
    def shape(chunks: Sequence[PrefillChunk]) -> tuple[int, int] | None:
        if len(chunks) != 1 or chunks[0].rows < 2:
            return None
        return query_bucket(chunks[0].rows), history_bucket(chunks[0].history + chunks[0].rows, 1024)

    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        return self.shape(chunks) in self.shapes

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> None:
        if (shape := self.shape(chunks)) is not None:
            self.waiting.add(shape)

    def stand_in(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float | None) -> None:
        return None  # no larger trace stands in here

    def stand_in_run_ms(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float) -> None:
        return None

    def quiet(self) -> None:
        self.shapes |= self.waiting
        self.waiting.clear()


def contended_reads(
    target_ms: float,
    passes: int = 4,
    compiled_ms: Callable[[int, int], float] = h200_compiled_ms,
    trust_factor: float = TRUST_FACTOR,
) -> list[dict]:
    """8 streams decode; a 16k prompt arrives, is read, the streams go on; the engine is quiet; again. Each pass's
    TTFT, its prefill steps' rows, how many replayed a trace, and its slowest step."""
    traces = BucketTraces()
    config = SchedulerConfig(
        num_blocks=8192, cost_model="affine", step_target_ms=target_ms, kv_bucket=1024, cost_trust_factor=trust_factor,
        plan_headroom=1.0,
        floor_slack=1.0,  # the traces and the trust region alone (`test_step_target` covers the slack)
    )
    scheduler = Scheduler(config, traced_shapes=traces)
    for index in range(8):
        scheduler.add(make_request(f"stream{index}", 512, max_tokens=100_000, base=1000 * (index + 1)))
    now = 0.0

    def step() -> tuple[int, float, bool]:
        nonlocal now
        plan = scheduler.schedule(now)
        chunks = tuple(PrefillChunk(lane.rows, lane.history) for lane in plan.lanes if lane.kind is LaneKind.PREFILL)
        compiled = traces.traced(chunks, ()) and len(chunks) < len(plan.lanes)
        if not chunks:
            elapsed = 5.6  # a decode-only step
        elif compiled:
            elapsed = compiled_ms(chunks[0].rows, chunks[0].history)
        else:
            elapsed = sum(h200_eager_ms(c.rows, c.history, compiled_ms) for c in chunks)
            traces.want(chunks, ())  # met, run eager: traced when quiet
        now += elapsed / 1000
        scheduler.update(plan, fake_outcome(plan, elapsed, compiled=compiled), now)
        return plan.prefill_rows, elapsed, compiled

    for _ in range(40):
        step()
    reads = []
    for index in range(passes):
        scheduler.add(make_request(f"long{index}", 16_384, max_tokens=1, base=10_000_000 * (index + 1)))
        start, steps = now, []
        while scheduler.get(f"long{index}") is not None:
            rows, elapsed, compiled = step()
            if rows:
                steps.append((rows, elapsed, compiled))
        rows, elapsed, compiled = zip(*steps, strict=True)
        reads.append({"ttft_ms": (now - start) * 1e3, "rows": set(rows), "replayed": sum(compiled),
                      "steps": len(steps), "slowest_ms": max(elapsed)})  # fmt: skip
        for _ in range(20):
            step()
        traces.quiet()
    return reads


@pytest.mark.parametrize("target_ms", [12.0, 15.0])
def test_repeated_contended_reads_move_to_larger_traced_steps(target_ms: float) -> None:
    """Closed loop, with step costs drawn from the H200 (0.6B, host-bound when eager): the first read runs eager
    512-row steps; from what it taught, the scheduler wants larger compiled shapes, the quiet engine traces them,
    and by the fourth read every step replays a trace, some carry more than 512 rows, steps stay within the target
    and the TTFT falls by a fifth. Counted in single rows, the fit put the fixed cost on its rows slope when every
    step had 512 rows, and a 12 ms target stayed at 512-row steps for good."""
    first, *_, last = contended_reads(target_ms)
    assert first["replayed"] == 0
    assert last["replayed"] >= 0.9 * last["steps"]
    assert max(last["rows"]) > 512
    assert last["slowest_ms"] <= 1.1 * target_ms
    assert last["ttft_ms"] <= 0.8 * first["ttft_ms"]


def kinked_compiled_ms(rows: int, history: int) -> float:
    """As `h200_compiled_ms` to 1,024 rows, dearer per row past them: the H200's 0.6B ran a 2,040-row step in 31.8 ms
    where a fit of its 1,024-row steps said 21.3 (twentieth run, call D)."""
    return h200_compiled_ms(rows, history) + 0.012 * max(query_bucket(rows) - 1024, 0)


def test_the_trust_region_keeps_a_first_read_from_jumping_past_what_it_has_measured() -> None:
    """At a 20 ms target the first read's fit, trained on steps to 1,024 rows, plans 2,040 rows, which run at
    twice the target; believed only 1.5x past its largest step, the budget grows a bucket at a time and every step
    of every read stays near the target, the first read's TTFT no worse."""
    believed = contended_reads(20.0, passes=2, compiled_ms=kinked_compiled_ms, trust_factor=0)
    bounded = contended_reads(20.0, passes=2, compiled_ms=kinked_compiled_ms)
    assert believed[0]["slowest_ms"] > 1.5 * 20.0
    assert all(read["slowest_ms"] <= 1.25 * 20.0 for read in bounded)
    assert bounded[0]["ttft_ms"] <= believed[0]["ttft_ms"]
