"""Policy rules: priority classes, bounded overtaking, the seed's halving case, decode debt, ANE placement,
and the trace of every decision."""

from __future__ import annotations

import pytest
from scheduler_helpers import fake_outcome, make_request, run_step

from scheduler import LaneKind, Path, Priority, Scheduler, SchedulerConfig, StepOutcome
from scheduler.cost_models import BucketedCostModel, PrefillChunk, StepShape, cell_index
from tracing.events import RequestAdmitted, StepPlanned
from tracing.sink import MemorySink


def prefill_ids(plan) -> list[str]:
    return [lane.request_id for lane in plan.lanes if lane.kind is LaneKind.PREFILL]


def test_priority_class_comes_before_shortest_first() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=512, row_ceiling=256, row_floor=64))
    scheduler.add(make_request("short-normal", 20))
    scheduler.add(make_request("long-high", 300, priority=Priority.HIGH, base=5000))
    scheduler.add(make_request("short-low", 10, priority=Priority.LOW, base=9000))
    assert prefill_ids(scheduler.schedule(0.0)) == ["long-high"]  # 256 rows: all of the budget


def test_a_request_overtaken_k_times_goes_to_the_front_of_its_class() -> None:
    sink = MemorySink()
    scheduler = Scheduler(SchedulerConfig(num_blocks=1024, row_ceiling=64, row_floor=64, max_overtakes=2), sink)
    long_request = make_request("long", 200, max_tokens=1)
    scheduler.add(long_request)
    served_long_at = None
    for step in range(6):
        scheduler.add(make_request(f"short{step}", 64, max_tokens=1, base=10_000 * (step + 1)))
        plan = run_step(scheduler, step * 0.01)
        if "long" in prefill_ids(plan) and served_long_at is None:
            served_long_at = step
            assert prefill_ids(plan)[0] == "long"
    assert served_long_at == 2
    assert long_request.times_overtaken == 2
    overtakes = [e.overtakes for e in sink.events if isinstance(e, StepPlanned)]
    assert overtakes[:2] == [("long",), ("long",)] and scheduler.stats.overtakes == 2


def test_seed_case_non_leading_long_history_lane_halves_a_trained_budget_without_reordering() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=2048, cost_model="bucketed"))
    scheduler.add(make_request("long", 24_000, max_tokens=1))
    scheduler.add(make_request("stream", 10, max_tokens=100, base=50_000))
    for step in range(9):  # the long prompt builds up history while "stream" decodes beside it
        run_step(scheduler, step * 0.01, elapsed_ms=10.0)
    history = scheduler.get("long").num_computed
    assert history > 16_384
    scheduler.cost_model = model = BucketedCostModel()
    slow = StepShape((PrefillChunk(100, 0), PrefillChunk(1947, history)), 1)
    hidden = StepShape((PrefillChunk(100, 0), PrefillChunk(1947, 0)), 1)  # what a leading-lane history would see
    for _ in range(3):
        model.observe(slow, 0.4 * slow.prefill_rows)  # long history: 0.4 ms/row
        model.observe(hidden, 0.1 * hidden.prefill_rows)  # short history: 0.1 ms/row
    assert model.predict(hidden) < 500 < model.predict(slow)
    scheduler.add(make_request("short", 100, max_tokens=1, base=90_000))
    plan = scheduler.schedule(0.09)
    assert plan.row_budget == 1024 and plan.budget_reason == "halved:1"
    assert prefill_ids(plan) == ["short", "long"]  # shortest first, as with the full budget
    assert [lane.rows for lane in plan.lanes if lane.kind is LaneKind.PREFILL] == [100, 924]
    assert plan.predicted_ms <= 500 and scheduler.stats.budget_halvings == 1


def test_decode_debt_skips_prefill_for_one_step_after_a_slow_step() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=1024, step_target_ms=100.0))
    scheduler.add(make_request("stream", 10, max_tokens=50))
    run_step(scheduler, 0.0)
    run_step(scheduler, 0.01)  # first decode: the stream now has an inter-token gap
    scheduler.add(make_request("prompt", 5000, base=7000))
    slow = scheduler.schedule(0.02)
    assert prefill_ids(slow) == ["prompt"]
    scheduler.update(slow, fake_outcome(slow, elapsed_ms=400.0), 0.42)  # the prediction was wrong: 400 ms
    debt = scheduler.schedule(0.42)
    assert debt.budget_reason == "decode-debt" and debt.prefill_rows == 0
    assert [lane.request_id for lane in debt.lanes] == ["stream"]
    scheduler.update(debt, fake_outcome(debt, elapsed_ms=5.0), 0.425)
    resumed = scheduler.schedule(0.425)
    assert resumed.budget_reason != "decode-debt" and resumed.prefill_rows >= 64
    assert scheduler.stats.decode_debt_steps == 1


def test_ane_lane_takes_a_chunk_predicted_faster_and_trains_the_committed_path() -> None:
    config = SchedulerConfig(num_blocks=1024, cost_model="bucketed", ane_lane=True, step_target_ms=5000.0)
    scheduler = Scheduler(config)
    model = scheduler.cost_model
    gpu_shape = StepShape((PrefillChunk(40, 0), PrefillChunk(600, 0)), 1)
    ane_shape = StepShape((PrefillChunk(600, 0),), 0, Path.ANE)
    for _ in range(3):
        model.observe(gpu_shape, 2.0 * gpu_shape.prefill_rows)
        model.observe(ane_shape, 0.5 * ane_shape.prefill_rows)
    scheduler.add(make_request("stream", 10, max_tokens=50))
    run_step(scheduler, 0.0)
    scheduler.add(make_request("short", 40, base=3000))
    scheduler.add(make_request("long", 600, base=5000))
    plan = scheduler.schedule(0.01)
    paths = {lane.request_id: lane.path for lane in plan.lanes}
    assert paths == {"stream": Path.GPU, "short": Path.GPU, "long": Path.ANE}
    scheduler.get("long").in_flight_path = Path.GPU.value  # moved while in flight: still trains the ANE cell
    ane_cell, gpu_cell = cell_index(ane_shape), cell_index(StepShape((PrefillChunk(40, 0),), 1))
    before = (model.samples[ane_cell], model.samples[gpu_cell])
    outcome = StepOutcome({"stream": 1, "short": 1, "long": 1}, elapsed_ms=30.0, ane_elapsed_ms=250.0)
    scheduler.update(plan, outcome, 0.3)
    assert model.samples[ane_cell] == before[0] + 1
    assert model.samples[gpu_cell] == before[1]  # 40 rows: too few to train, and never the ANE's time


@pytest.mark.parametrize("gpu_only", [False, True])
def test_a_gpu_only_request_never_takes_the_ane_lane(gpu_only: bool) -> None:
    """The same step as above: the long chunk predicted faster on the ANE stays on the GPU when its request is
    `gpu_only` (its prompt is scored: every row's hidden state is needed)."""
    config = SchedulerConfig(num_blocks=1024, cost_model="bucketed", ane_lane=True, step_target_ms=5000.0)
    scheduler = Scheduler(config)
    gpu_shape = StepShape((PrefillChunk(40, 0), PrefillChunk(600, 0)), 1)
    ane_shape = StepShape((PrefillChunk(600, 0),), 0, Path.ANE)
    for _ in range(3):
        scheduler.cost_model.observe(gpu_shape, 2.0 * gpu_shape.prefill_rows)
        scheduler.cost_model.observe(ane_shape, 0.5 * ane_shape.prefill_rows)
    scheduler.add(make_request("stream", 10, max_tokens=50))
    run_step(scheduler, 0.0)
    scheduler.add(make_request("short", 40, base=3000))
    long_request = make_request("long", 600, base=5000)
    long_request.gpu_only = gpu_only
    scheduler.add(long_request)
    paths = {lane.request_id: lane.path for lane in scheduler.schedule(0.01).lanes}
    assert paths["long"] is (Path.GPU if gpu_only else Path.ANE)


def test_every_decision_is_traced() -> None:
    sink = MemorySink()
    scheduler = Scheduler(SchedulerConfig(num_blocks=256), sink)
    scheduler.add(make_request("a", 30))
    plan = scheduler.schedule(0.0)
    planned = [e for e in sink.events if isinstance(e, StepPlanned)]
    admitted = [e for e in sink.events if isinstance(e, RequestAdmitted)]
    assert [(e.request_id, e.cached_tokens) for e in admitted] == [("a", 0)]
    (event,) = planned
    assert event.step_id == plan.step_id and event.row_budget == 2048 and event.budget_reason == "uncontended"
    assert [(lane.request_id, lane.kind, lane.rows, lane.history, lane.path) for lane in event.lanes] == [
        ("a", "prefill", 30, 0, "gpu")
    ]


def test_a_slow_decode_only_step_is_not_decode_debt() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=1024, step_target_ms=100.0))
    scheduler.add(make_request("stream", 10, max_tokens=50))
    run_step(scheduler, 0.0)
    slow = scheduler.schedule(0.01)
    scheduler.update(slow, fake_outcome(slow, elapsed_ms=300.0), 0.31)  # decode only, yet slow
    scheduler.add(make_request("prompt", 500, base=7000))
    plan = scheduler.schedule(0.31)
    assert plan.budget_reason != "decode-debt" and prefill_ids(plan) == ["prompt"]


def test_a_halved_budget_grows_to_fill_its_last_row_tile() -> None:
    """8 decode lanes beside a long prompt, halved to the 64-row floor: with 64-row tiles the step carries 120
    prefill rows (8 + 120 = two full tiles, what 8 + 64 already cost), without tiles 64."""
    budgets = {}
    for quantum in (1, 64):
        config = SchedulerConfig(num_blocks=4096, cost_model="ema", step_target_ms=20.0, row_quantum=quantum)
        scheduler = Scheduler(config)
        for index in range(8):
            scheduler.add(make_request(f"stream{index}", 4, max_tokens=500, base=1000 * (index + 1)))
        run_step(scheduler, 0.0, elapsed_ms=5.0)  # the streams' prompts, uncontended
        scheduler.add(make_request("long", 16_000, max_tokens=1, base=900_000))
        scheduler.cost_model.observe(StepShape((PrefillChunk(256, 0),), 8), 256 * 1.0)  # 1 ms a row
        plan = scheduler.schedule(0.01)
        decode_lanes = [lane for lane in plan.lanes if lane.kind is LaneKind.DECODE]
        assert len(decode_lanes) == 8 and plan.budget_reason.startswith("halved")
        budgets[quantum] = (plan.row_budget, plan.prefill_rows)
    assert budgets == {1: (64, 64), 64: (120, 120)}


def test_fill_row_tile_edges() -> None:
    from scheduler.budget import fill_row_tile

    assert fill_row_tile(64, 8, 64, 2048) == 120  # two tiles: 8 + 120
    assert fill_row_tile(56, 8, 64, 2048) == 56  # already ends on a tile
    assert fill_row_tile(128, 8, 64, 2048) == 184
    assert fill_row_tile(2048, 8, 64, 2048) == 2048  # never below the budget, even at the ceiling
    assert fill_row_tile(1024, 8, 64, 1040) == 1032  # never past the ceiling: 8 + 1032 = 1040
    assert fill_row_tile(0, 8, 64, 2048) == 0  # a decode-debt step stays without prefill
    assert fill_row_tile(64, 8, 1, 2048) == 64  # off


def test_padded_chunks_take_the_rows_they_pay_for() -> None:
    """Where the engine pads a chunk to its query bucket, the budget grows to that bucket: the budget that filled 8
    lanes' five 64-row tiles (312) ran as 384 rows, a 16k prompt's last 1,552 rows as 2,048."""
    from scheduler.budget import paid_rows

    padded = SchedulerConfig(num_blocks=8, kv_bucket=1024, row_quantum=64)
    assert fill_row_tile_of(256, padded) == 384 and fill_row_tile_of(384, padded) == 512  # 312, 440 tile-filled
    assert fill_row_tile_of(1552, padded) == 2048 and fill_row_tile_of(0, padded) == 0
    assert fill_row_tile_of(256, SchedulerConfig(num_blocks=8, kv_bucket=1024)) == 256  # a bucket already
    assert paid_rows(1000, 8, SchedulerConfig(num_blocks=8, kv_bucket=1024, row_ceiling=1000)) == 1000
    assert fill_row_tile_of(256, SchedulerConfig(num_blocks=8, row_quantum=64)) == 312  # no padding: the tile alone


def fill_row_tile_of(budget: int, config: SchedulerConfig) -> int:
    from scheduler.budget import paid_rows

    return paid_rows(budget, 8, config)


def test_a_padded_last_chunk_is_planned_at_its_padded_cost() -> None:
    """A 1,552-row prompt beside 8 streams (like a 16k prompt's last chunk): the engine runs it as 2,048 rows, over
    the target. Planned with the padding, the step carries 1,536 rows (a bucket that fits) and leaves 16."""
    from scheduler.affine_cost import AffineCostModel
    from tests.scheduler.test_cost_models import padded_cost

    def plan_last_chunk(kv_bucket: int) -> int:
        config = SchedulerConfig(
            num_blocks=8192, cost_model="affine", step_target_ms=14.5, kv_bucket=kv_bucket, plan_headroom=1.0
        )
        scheduler = Scheduler(config)
        model = scheduler.cost_model
        assert isinstance(model, AffineCostModel)
        for index in range(300):  # trained on steps timed as the engine runs them (padded)
            rows = (256, 384, 512, 768, 1024, 1536, 2048)[index % 7]
            shape = StepShape((PrefillChunk(rows, (index * 977) % 15_000),), 8)
            model.observe(shape, padded_cost(shape))
        for index in range(8):
            scheduler.add(make_request(f"stream{index}", 4, max_tokens=500, base=1000 * (index + 1)))
        run_step(scheduler, 0.0, elapsed_ms=5.0)
        scheduler.add(make_request("long", 1552, max_tokens=1, base=900_000))
        plan = scheduler.schedule(0.01)
        return plan.prefill_rows

    over, fits = (padded_cost(StepShape((PrefillChunk(rows, 0),), 8)) for rows in (1552, 1536))
    assert over > 14.5 >= fits
    assert plan_last_chunk(1024) == 1536
    assert plan_last_chunk(0) == 1552  # counted exactly, the whole rest looks like it fits (predicted 14.0 ms)
