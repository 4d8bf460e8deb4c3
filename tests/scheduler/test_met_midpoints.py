"""`met_midpoints`: a halved budget grows by half (`budget_midpoints`) only where the wider step's shape has run
before in the form it would run; otherwise it keeps the halved budget and asks for the wider step's trace. It
declines fewer midpoints than `traced_midpoints`: an eager midpoint of a shape already run is taken."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import SMALL_STEP_COSTS, LinearCostModel
from test_traced_shapes import plan_beside_streams

from scheduler import SchedulerConfig
from scheduler.budget import choose_row_budget
from scheduler.cost_models import PrefillChunk

LANES = 8
ROWS = [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]


def _decide(met_rows: set[int] | None, model=None, target_ms: float = 21.0, on: bool = True,
            prompt_rows: int = 16_000, traced_rows: frozenset[int] = frozenset()):  # fmt: skip
    """A 0.6B-like step beside 8 streams (8 ms fixed, 0.008 ms a row, eager 0.5 ms dearer); `met_rows`: the step
    sizes whose shapes have run (None: the engine cannot say)."""
    config = SchedulerConfig(
        num_blocks=4096, plan_headroom=1.0, kv_bucket=1024, floor_slack=1.0, met_midpoints=on
    )
    demand = [PrefillChunk(rows=prompt_rows, history=4096)]

    def rows(chunks) -> int:
        return sum(chunk.rows for chunk in chunks)

    met = None if met_rows is None else lambda chunks: rows(chunks) in met_rows
    return choose_row_budget(config, model or LinearCostModel(8.0, 0.008, eager_ms=0.5), demand, LANES, False, True,
                             target_ms, lambda chunks: rows(chunks) in traced_rows, None, met)  # fmt: skip


def test_a_midpoint_of_a_shape_never_run_is_declined_and_its_trace_asked_for():
    """2,048 rows are over 21 ms, 1,024 fit (16.7 ms), 1,536 fit too (20.8 ms, eager) but never ran: the step stays
    at 1,024 rows and wants 1,536's trace; once 1,536 has run, the midpoint is taken (eager, as before)."""
    plain = _decide({1024}, on=False)
    assert (plain.row_budget, plain.reason) == (1536, "halved:1+half")
    kept = _decide({1024})
    assert (kept.row_budget, kept.reason) == (1024, "halved:1+unmet")
    assert kept.wanted == (PrefillChunk(rows=1536, history=4096),)
    assert (_decide({1024, 1536}).row_budget, _decide({1536}).reason) == (1536, "halved:1+half")
    assert _decide(None).reason == "halved:1+half"  # the engine cannot say: nothing declined


@settings(max_examples=300, deadline=None)
@given(
    **SMALL_STEP_COSTS,
    prompt_rows=st.integers(1, 5000),
    met_rows=st.sets(st.sampled_from(ROWS)),
    traced_rows=st.frozensets(st.sampled_from(ROWS)),
)
def test_the_rule_only_declines_midpoints_of_shapes_never_run(
    fixed_ms, row_ms, eager_ms, target_ms, prompt_rows, met_rows, traced_rows
):
    """Against the decision without it: never larger; where the two differ, the plain one took a midpoint whose
    step's shape never ran, the kept one is the halved budget before it (the same halvings, the same prediction as
    that budget alone) and asks for a trace at least as wide."""
    model = LinearCostModel(fixed_ms, row_ms, eager_ms=eager_ms)
    plain = _decide(met_rows, model, target_ms, False, prompt_rows, traced_rows)
    kept = _decide(met_rows, model, target_ms, True, prompt_rows, traced_rows)
    if kept.row_budget == plain.row_budget:
        assert kept.reason == plain.reason
        return
    assert kept.row_budget < plain.row_budget
    assert plain.reason.endswith("+half") and kept.reason.endswith("+unmet")
    assert plain.reason.split("+")[0] == kept.reason.split("+")[0]
    assert min(plain.row_budget, prompt_rows) not in met_rows
    assert kept.predicted_ms <= target_ms
    assert sum(chunk.rows for chunk in kept.wanted) >= min(plain.row_budget, prompt_rows)


class FakeShapes:
    """Traces and shapes run, by the chunk's rows (any history, any lanes); records what the scheduler asks for."""

    def __init__(self, traced_rows: set[int], met_rows: set[int]) -> None:
        self.traced_rows, self.met_rows = traced_rows, met_rows
        self.wanted: list[int] = []

    def traced(self, chunks, decode) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.traced_rows

    def met(self, chunks, decode) -> bool:
        return len(chunks) == 1 and chunks[0].rows in self.met_rows

    def want(self, chunks, decode) -> None:
        self.wanted.append(sum(chunk.rows for chunk in chunks))


def test_the_scheduler_asks_the_engine_which_shapes_have_run():
    """Through `Scheduler` (`plan_beside_streams`): 8 streams decoding and a 4,000-token prompt at a 14 ms target, 1,024 and 1,536 rows both
    traced (compiled 9.2 and 13.3 ms). A 1,536-row trace that has not run yet is declined and asked for again; once
    it has run, the midpoint is the step."""
    plans = {}
    for met_rows in ({1024}, {1024, 1536}):
        shapes = FakeShapes({1024, 1536}, met_rows)
        _, plan = plan_beside_streams(shapes, met_midpoints=True)
        plans[len(met_rows)] = (plan.prefill_rows, shapes.wanted)
    assert plans == {1: (1024, [1536]), 2: (1536, [])}
