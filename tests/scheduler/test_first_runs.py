"""`price_first_runs`: a contended candidate whose shape never ran in its form is priced with what such first runs
measured over their prices (`scheduler/first_runs.py`), so the budget halves past a new shape that would overrun the
target with its one-off work."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import (
    SMALL_STEP_COSTS,
    FakeShapes,
    LinearCostModel,
    fake_outcome,
    make_request,
    run_step,
)
from test_traced_shapes import plan_beside_streams

from scheduler import Scheduler, SchedulerConfig
from scheduler.budget import choose_row_budget
from scheduler.cost_models import PrefillChunk
from scheduler.first_runs import FIRST_RUNS_LEAST, SWAP_LEAST_SHARE, FirstRunPrice

LANES = 8
ROWS = [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]


def _decide(met_rows: set[int] | bool | None, first_run_ms: float, model=None, target_ms: float = 11.0,
            prompt_rows: int = 16_000, contended: bool = True):  # fmt: skip
    """A 0.6B-like step beside 8 streams on an H100 (3 ms fixed, 0.007 ms a row, eager 0.5 ms dearer), nothing
    traced; `met_rows`: the step sizes whose shapes have run (True: every one; None: the engine cannot say)."""
    config = SchedulerConfig(num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.0)
    demand = [PrefillChunk(rows=prompt_rows, history=0)]

    def rows(chunks) -> int:
        return sum(chunk.rows for chunk in chunks)

    met = None if met_rows is None else lambda chunks: met_rows is True or rows(chunks) in met_rows
    return choose_row_budget(config, model or LinearCostModel(3.0, 0.007, eager_ms=0.5), demand, LANES, False,
                             contended, target_ms, lambda chunks: False, None, met, first_run_ms)  # fmt: skip


def test_a_new_shape_that_would_overrun_with_its_first_run_gives_way_to_one_that_has_run():
    """1,024 eager rows are priced 10.7 ms against 11: taken where they have run, where no first run is priced, or
    where the engine cannot say. With first runs 3.5 ms dear and 1,024 never run, the step takes the largest smaller
    budget whose shape has run (512: 7.1 ms; 768: 8.9 ms) and asks for 1,024's trace; where none has run, or only
    one under half its rows, it pays the first run rather than shrink onto other new shapes or many more steps."""
    assert _decide({1024}, 3.5).row_budget == 1024
    assert _decide(set(), 0.0).row_budget == 1024
    assert _decide(None, 3.5).row_budget == 1024
    assert _decide(set(), 3.5).row_budget == 1024
    kept = _decide({512}, 3.5)
    assert (kept.row_budget, kept.reason) == (512, "halved:1+first-run")
    assert abs(kept.predicted_ms - (3.0 + 0.007 * 512 + 0.5)) < 1e-9
    assert kept.wanted == (PrefillChunk(rows=1024, history=0),)
    assert _decide({512, 768}, 3.5).row_budget == 768
    assert _decide({256}, 3.5).row_budget == 1024  # a quarter of the rows: the first run is paid, not 4x the steps
    assert _decide({512}, 0.3).row_budget == 1024  # 10.7 + 0.3 ms fits: the first run is paid
    assert _decide({512}, 3.5, contended=False).row_budget == 2048  # uncontended: no target


@settings(max_examples=300, deadline=None)
@given(**SMALL_STEP_COSTS, prompt_rows=st.integers(1, 5000), met_rows=st.sets(st.sampled_from(ROWS)),
       first_run_ms=st.floats(0.0, 20.0))  # fmt: skip
def test_a_first_run_only_gives_way_to_a_smaller_step_that_has_run_and_fits(
    fixed_ms, row_ms, eager_ms, target_ms, prompt_rows, met_rows, first_run_ms
):
    """Against the decision without it: never larger; the same wherever every shape has run; where it differs, the
    plain step's shape never ran and would overrun with its first run, and the one taken has run, reads fewer rows
    (but at least half the budget's) and is predicted within the target."""
    model = LinearCostModel(fixed_ms, row_ms, eager_ms=eager_ms)
    plain = _decide(met_rows, 0.0, model, target_ms, prompt_rows)
    priced = _decide(met_rows, first_run_ms, model, target_ms, prompt_rows)
    assert _decide(True, first_run_ms, model, target_ms, prompt_rows) == _decide(True, 0.0, model, target_ms, prompt_rows)
    if priced.row_budget == plain.row_budget:
        return
    assert priced.row_budget < plain.row_budget and priced.reason.endswith("+first-run")
    assert min(plain.row_budget, prompt_rows) not in met_rows
    assert plain.predicted_ms + first_run_ms > target_ms
    assert min(priced.row_budget, prompt_rows) in met_rows and min(priced.row_budget, prompt_rows) < min(plain.row_budget, prompt_rows)
    assert priced.predicted_ms <= target_ms
    assert min(priced.row_budget, prompt_rows) >= min(plain.row_budget, prompt_rows) * SWAP_LEAST_SHARE


def test_the_price_is_the_median_excess_of_contended_first_runs():
    """Only contended steps with prefill, flagged first runs, priced and timed count (not other one-off steps, such
    as stand-ins); none until three are seen; the median of the last ones, never below zero."""
    _, plan = plan_beside_streams(FakeShapes(set(), set()))
    assert plan.contended and plan.prefill_rows and plan.predicted_ms is not None
    price = FirstRunPrice(kept=4)
    predicted = plan.predicted_ms
    for ignored in (fake_outcome(plan, predicted + 50.0),  # not one-off
                    fake_outcome(plan, predicted + 50.0, auxiliary=True),  # one-off, no first run (a stand-in)
                    fake_outcome(plan, predicted + 50.0, auxiliary=True, first_run=True, failed={"long": "boom"}),
                    fake_outcome(plan, math.nan, auxiliary=True, first_run=True)):  # in flight: timed later  # fmt: skip
        price.observe(plan, ignored)
    assert price.extra_ms == 0.0
    for over in (6.0, 2.0):
        price.observe(plan, fake_outcome(plan, predicted + over, auxiliary=True, first_run=True))
    assert price.extra_ms == 0.0  # two seen: FIRST_RUNS_LEAST is 3
    assert FIRST_RUNS_LEAST == 3
    price.observe(plan, fake_outcome(plan, predicted + 4.0, auxiliary=True, first_run=True))
    assert abs(price.extra_ms - 4.0) < 1e-9
    for _ in range(4):  # the window keeps the last 4: steps under their price now
        price.observe(plan, fake_outcome(plan, predicted - 1.0, auxiliary=True, first_run=True))
    assert price.extra_ms == 0.0


def _plans_of_a_long_prompt(on: bool, over_ms: float, steps: int = 12) -> list[int]:
    """8 streams decoding at a 14 ms target, a 16,000-token prompt arrives; 1,024 and 1,536 rows traced (compiled
    9.2 and 13.3 ms at any history), only 1,024 ever run. Every step with prefill is reported one-off, `over_ms` over its price
    (each new shape's first run, as a live pass's first steps are). The prompt's chunk sizes, step by step (decode
    debt steps left out)."""
    shapes = FakeShapes({1024, 1536}, {1024})
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_ms=14.0, floor_slack=1.0, price_first_runs=on
    )
    scheduler = Scheduler(config, traced_shapes=shapes)
    scheduler.cost_model = LinearCostModel(1.0, 0.008, eager_ms=9.0)  # any history: compiled 1 ms + 0.008 a row
    for index in range(8):
        scheduler.add(make_request(f"stream{index}", 4, max_tokens=500, base=1000 * (index + 1)))
    run_step(scheduler, 0.0, elapsed_ms=5.0)
    scheduler.add(make_request("long", 16_000, max_tokens=1, base=900_000))
    rows, now = [], 0.01
    for _ in range(steps):
        plan = scheduler.schedule(now)
        if plan.prefill_rows:
            rows.append(plan.prefill_rows)
            elapsed = plan.predicted_ms + over_ms
            outcome = fake_outcome(plan, elapsed, auxiliary=True, first_run=True)
        else:  # a decode-debt step: the streams' own
            elapsed, outcome = 5.0, fake_outcome(plan, 5.0)
        scheduler.update(plan, outcome, now + elapsed / 1e3)
        now += elapsed / 1e3
    return rows


def test_the_scheduler_prices_first_runs_once_it_has_seen_three():
    """Off, or with first runs at their price, the never-run 1,536-row trace is taken every step. On, after three
    one-off steps 5 ms over their prices (13.3 + 5 ms is over 14), the step halves to the 1,024 rows that have run."""
    assert _plans_of_a_long_prompt(False, 5.0)[:6] == [1536] * 6
    assert _plans_of_a_long_prompt(True, 0.0)[:6] == [1536] * 6
    assert _plans_of_a_long_prompt(True, 5.0)[:6] == [1536] * 3 + [1024] * 3
