"""`paced_slowdown`: a contended step's target rises from step_target_factor x the decode step, a quarter at a time
up to paced_factor_cap x, until the leading prompt's predicted read under it fits what is left of its TTFT allowance
(`paced_slowdown` x its predicted read alone, less the time since its arrival)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import LINEAR_COSTS, LinearCostModel, fake_outcome, make_request

from scheduler import Scheduler, SchedulerConfig
from scheduler.buckets import query_bucket
from scheduler.cost_models import PrefillChunk
from scheduler.prompt_pace import PACE_REFRESH_ROWS, PromptPace, paced_target_ms, read_ms, read_steps, solo_ms

CEILING = 2048


def linear(fixed_ms: float, row_ms: float, pair_ms: float = 0.0):
    return lambda rows, history: fixed_ms + row_ms * rows + pair_ms * rows * (history + rows / 2)


@settings(max_examples=300, deadline=None)
@given(
    fixed_ms=st.floats(0.0, 30.0),
    row_ms=st.floats(0.0005, 0.05),
    pair_ms=st.floats(0.0, 2e-6),
    rows=st.integers(1, 20000),
    history=st.integers(0, 16000),
    limit_ms=st.floats(1.0, 200.0),
)
def test_each_step_is_the_widest_within_the_limit(fixed_ms, row_ms, pair_ms, rows, history, limit_ms) -> None:
    """Steps read exactly the prompt's rows, each priced within the limit, each a query bucket (or the rows left), and
    the next wider bucket (within the ceiling and the rows left) over the limit; None only where the first step's
    narrowest chunk is over it (a price rising with history never lets a narrower one fit later)."""
    price = linear(fixed_ms, row_ms, pair_ms)
    steps = read_steps(price, rows, history, limit_ms, CEILING)
    if steps is None:
        assert price(min(64, rows), history) > limit_ms or any(
            price(min(64, rows - done), history + done) > limit_ms for done in range(0, rows, 64)
        )
        return
    assert sum(taken for taken, _ in steps) == rows
    done = 0
    for taken, cost in steps:
        left = rows - done
        assert cost == price(taken, history + done) and cost <= limit_ms
        assert taken == left or (taken == query_bucket(taken) and taken <= CEILING)
        wider = query_bucket(taken + 1)
        if taken < left and wider <= CEILING:
            assert price(min(wider, left), history + done) > limit_ms
        done += taken


def test_the_read_alone_is_in_ceiling_chunks() -> None:
    price = linear(10.0, 0.01)
    assert solo_ms(price, 5000, 0, CEILING) == pytest.approx(3 * 10.0 + 0.01 * 5000)
    assert solo_ms(lambda rows, history: None, 5000, 0, CEILING) is None
    assert read_steps(lambda rows, history: None, 5000, 0, 50.0, CEILING) is None


# a step of 10 ms + 0.01 ms a row (no decode lanes' cost): at a 25 ms target 1,024-row steps read 5,000 rows in 100 ms,
# at 27.5 and 30 ms 1,536-row steps in 90 ms; alone, 2,048-row chunks in 80 ms
PRICE = linear(10.0, 0.01)


@pytest.mark.parametrize(
    "left_ms,target_ms",
    [(100.0, 25.0), (99.0, 27.5), (90.0, 27.5), (89.0, 30.0), (-5.0, 30.0)],
)
def test_the_least_factor_whose_read_fits_what_is_left(left_ms, target_ms) -> None:
    chunk = PrefillChunk(5000, 0)
    assert paced_target_ms(chunk, left_ms, 10.0, 2.5, 3.0, 0.0, PRICE, CEILING) == target_ms


def test_the_floor_holds_and_a_cap_under_the_factor_is_the_factor() -> None:
    chunk = PrefillChunk(5000, 0)
    assert paced_target_ms(chunk, 100.0, 10.0, 2.5, 3.0, 26.0, PRICE, CEILING) == 26.0  # the floor over 2.5 x 10
    assert paced_target_ms(chunk, 0.0, 10.0, 2.5, 0.0, 0.0, PRICE, CEILING) == 25.0  # cap 0: the factor alone


def test_the_pace_is_worked_out_again_only_when_something_changed() -> None:
    pace, calls = PromptPace(), []

    def work() -> float:
        calls.append(1)
        return 25.0

    for history in (0, 512, PACE_REFRESH_ROWS - 1):
        assert pace.target_ms("a", history, 10.0, 8, work) == 25.0
    assert len(calls) == 1
    pace.target_ms("a", PACE_REFRESH_ROWS, 10.0, 8, work)  # read another block of rows
    pace.target_ms("a", PACE_REFRESH_ROWS, 11.0, 8, work)  # the decode step moved
    pace.target_ms("a", PACE_REFRESH_ROWS, 11.0, 7, work)  # a stream finished
    pace.target_ms("b", PACE_REFRESH_ROWS, 11.0, 7, work)  # another prompt leads
    assert len(calls) == 5
    assert pace.allowed_ms("a", lambda: 80.0) == 80.0
    assert pace.allowed_ms("a", lambda: 1.0) == 80.0  # once per prompt
    assert pace.allowed_ms("b", lambda: None) is None  # not priced yet: asked again
    assert pace.allowed_ms("b", lambda: 90.0) == 90.0


def _paced_plan(slowdown: float, waited_s: float, cap: float = 3.0, model: LinearCostModel | None = None,
                prompt: int = 5000):  # fmt: skip
    """One stream whose decode steps take 10 ms (factor 2.5: a 25 ms target), then a `prompt`-token prompt that
    arrived `waited_s` before it is planned, priced by `model` (default PRICE's: 10 ms + 0.01 ms a row, so a
    5,000-token prompt's read alone is 80 ms)."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_factor=2.5, step_target_floor_ms=0.0, floor_slack=1.0,
        paced_slowdown=slowdown, paced_factor_cap=cap
    )
    scheduler = Scheduler(config)
    scheduler.add(make_request("stream", 10, max_tokens=100))
    now = 0.0
    for _ in range(4):  # its prefill, then decode-only steps: the decode step is measured
        plan = scheduler.schedule(now)
        now += 0.010
        scheduler.update(plan, fake_outcome(plan, elapsed_ms=10.0), now)
    scheduler.cost_model = model or LinearCostModel(fixed_ms=10.0, row_ms=0.01)
    scheduler.add(make_request("prompt", prompt, base=7000, arrival_time=now - waited_s))
    return scheduler.schedule(now)


@pytest.mark.parametrize(
    "slowdown,waited_s,limit_ms,rows",
    [
        (0.0, 0.0, 25.0, 1024),  # off: the factor's target
        (1.3, 0.0, 25.0, 1024),  # 104 ms allowed: 1,024-row steps (100 ms) fit
        (1.2, 0.0, 27.5, 1536),  # 96 ms: 1,536-row steps (90 ms)
        (1.3, 0.010, 27.5, 1536),  # 104 ms less 10 waited
        (1.0, 0.0, 30.0, 1536),  # 80 ms: nothing fits, the cap's
    ],
)
def test_the_scheduler_plans_to_the_paced_target(slowdown, waited_s, limit_ms, rows) -> None:
    plan = _paced_plan(slowdown, waited_s)
    assert plan.limit_ms == pytest.approx(limit_ms)
    assert plan.prefill_rows == rows


def test_the_paced_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="paced_slowdown"):
        SchedulerConfig(num_blocks=16, paced_slowdown=0.5)
    with pytest.raises(ValueError, match="paced_factor_cap"):
        SchedulerConfig(num_blocks=16, paced_factor_cap=-1.0)


@settings(max_examples=150, deadline=None)
@given(
    **LINEAR_COSTS,
    slowdown=st.floats(1.0, 3.0),
    cap=st.floats(0.0, 5.0),
    waited_s=st.floats(0.0, 0.5),
    prompt=st.integers(65, 9000),
)
def test_the_paced_target_stays_between_the_factor_and_the_cap(fixed_ms, row_ms, lane_ms, slowdown, cap, waited_s,
                                                                prompt) -> None:  # fmt: skip
    """Whatever the prices and however long the prompt waited, a contended step is planned to a target on the ladder
    from the factor's (25 ms) to the cap's, and where the factor's read fits what is left, to the factor's."""
    model = LinearCostModel(fixed_ms, row_ms, lane_ms)
    plan = _paced_plan(slowdown, waited_s, cap, model, prompt)
    if plan.limit_ms is None:  # a debt step, or nothing contended
        return
    top = 10.0 * max(cap, 2.5)
    assert 25.0 - 1e-9 <= plan.limit_ms <= top + 1e-9
    rungs = [10.0 * (2.5 + k * 0.25) for k in range(int((max(cap, 2.5) - 2.5) / 0.25) + 2)]
    assert any(abs(plan.limit_ms - rung) < 1e-6 for rung in rungs) or abs(plan.limit_ms - top) < 1e-6
    alone = solo_ms(lambda rows, history: fixed_ms + row_ms * rows, prompt, 0, CEILING)
    factors = read_ms(lambda rows, history: max(fixed_ms + row_ms * rows + lane_ms, 10.0), prompt, 0, 25.0, CEILING)
    if factors is not None and factors <= slowdown * alone - waited_s * 1e3 - 1e-6:
        assert plan.limit_ms == pytest.approx(25.0)


def test_the_read_alone_is_scaled_by_what_uncontended_steps_measured() -> None:
    """Kept: uncontended GPU prefill steps of 256 rows or more that trained nothing else away; the scale is the median
    of measured / priced (eager), 1 before any."""
    from scheduler.plan import Lane, LaneKind, StepOutcome, StepPlan

    pace, model = PromptPace(), LinearCostModel(fixed_ms=10.0, row_ms=0.01, eager_ms=5.0)
    assert pace.alone_scale(model.predict) == 1.0

    def plan(rows: int, contended: bool = False, decode: int = 0) -> StepPlan:
        lanes = tuple(Lane(f"d{i}", LaneKind.DECODE, (1,), 10, (), True) for i in range(decode))
        lanes += (Lane("p", LaneKind.PREFILL, (1,) * rows, 0, (), False),)
        return StepPlan(1, lanes, rows, "uncontended", None, contended)

    priced = 10.0 + 0.01 * 2048 + 5.0  # eager, whatever form it ran in
    pace.observe_alone(plan(2048), StepOutcome({}, 2 * priced))
    pace.observe_alone(plan(2048), StepOutcome({}, 4 * priced))
    pace.observe_alone(plan(2048), StepOutcome({}, 3 * priced, compiled=True))
    pace.observe_alone(plan(128), StepOutcome({}, 50 * priced))  # too narrow
    pace.observe_alone(plan(2048, contended=True, decode=1), StepOutcome({}, 50 * priced))  # contended
    pace.observe_alone(plan(2048), StepOutcome({}, 50 * priced, auxiliary=True))  # one-off work rode along
    pace.observe_alone(plan(2048), StepOutcome({}, 50 * priced, failed={"p": "boom"}))
    pace.observe_alone(plan(2048), StepOutcome({}, None))  # a step updated before its time was known
    assert pace.alone_scale(model.predict) == pytest.approx(3.0)


def test_a_slow_read_alone_gives_the_prompt_room() -> None:
    """As `_paced_plan` with slowdown 1: 80 ms allowed, nothing fits, the cap's 30 ms target. Once the scheduler has
    seen an uncontended 2,048-row step run at twice its price, the read alone is 160 ms and the factor's 25 ms fits."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, step_target_factor=2.5, step_target_floor_ms=0.0, floor_slack=1.0,
        paced_slowdown=1.0
    )
    scheduler = Scheduler(config)
    scheduler.cost_model = LinearCostModel(fixed_ms=10.0, row_ms=0.01)
    scheduler.add(make_request("alone", 2048, max_tokens=1, base=20000))
    alone = scheduler.schedule(0.0)
    assert not alone.contended and alone.prefill_rows == 2048
    scheduler.update(alone, fake_outcome(alone, elapsed_ms=2 * (10.0 + 0.01 * 2048)), 0.05)
    scheduler.add(make_request("stream", 10, max_tokens=100, arrival_time=0.05))
    now = 0.05
    for _ in range(4):
        plan = scheduler.schedule(now)
        now += 0.010
        scheduler.update(plan, fake_outcome(plan, elapsed_ms=10.0), now)
    scheduler.add(make_request("prompt", 5000, base=7000, arrival_time=now))
    plan = scheduler.schedule(now)
    assert plan.limit_ms == pytest.approx(25.0) and plan.prefill_rows == 1024
