"""Row budgets: the ceiling when uncontended; halved toward the floor while a contended step is predicted over
the target, grown to the rows the engine pays for anyway (the step's last row tile, `SchedulerConfig.row_quantum`,
then the query bucket the engine pads that chunk to), then by half again where that is still predicted within the
target (`SchedulerConfig.budget_midpoints`); none at all for one step when a stream is in decode debt.

Where the engine pads chunks (`SchedulerConfig.kv_bucket`), rows between two query buckets are padding it runs
anyway: on the H200, 8B 4-bit budgets of 312 rows (8 lanes + 312 = five 64-row tiles) ran as 384, and a 16k
prompt's last 1,552 rows as 2,048 (31 ms against 25.8 predicted). The budget says so, and the prediction is the
padded step's.

Halving alone throws away up to half of what the target allows: on the H200, 30B-A3B beside 8 streams ran
512-row chunks in 72-77 ms against a 78 ms target, then 256-row chunks in ~50 ms for the rest of a 16k prompt,
where 384 rows fit. One more prediction per halved step takes the midpoint when it fits.

A step's fixed cost can fill the target by itself (H200, 8B 4-bit with its decode GEMV: a ~21 ms 128-row step
against a 20.4 ms target, 384 rows ~25 ms). Halving to the floor then buys nothing and stalls the prompt: every
contended step may take `floor_slack` times the floor step's prediction where that is more than the target
(`slack_allowance_ms`, reason `+slack`), and decode debt counts from that allowance too. Same run's code, one
contended run each: slack 1.25 16k TTFT 2.98x solo, gap 1.65; 1.5 TTFT 1.65x, gap 1.84. Where the floor step is
far over the target (`SLACK_WITHIN`) the fit is more likely wrong and the target holds (unguarded, a fresh fit once
grew a first step to 1,536 rows, 62 ms against 30), unless the steps doing no more work than the floor step were
measured over the planned target (`floor_measured_over`): then the price is no guess. Without that, a fresh engine's
first long prompt beside streams on an H100 (8B 4-bit, the sixty-first and sixty-second runs' first warm passes)
read 6-10k tokens in 78-98 eager 64-row steps of 19-36 ms, each over the target; replayed with it, those states read
in 192-512-row chunks (`replay_budgets --from-first-pass`), while of the measured passes of every recorded run (the
twenty-fourth to the sixty-second) one changed, at a few states (8B 4-bit, forty-ninth run: 256 rows -> 384-512).
On the other shapes measured the floor is well under the target and nothing changes, but for one case: where the floor
step is priced eager (its 64-row shape has no trace) on a model whose host makes eager steps dear, its prediction can
reach a compiled 2,040-row step's (H100, 0.6B beside 8 streams, fortieth run: 15.9 against 16.9 ms), and the slack then
let ceiling-sized chunks run 17-35 ms against a 14-19 ms target. So the slack applies only where a step of
`slack_guard_rows` (512) rows, compiled where the engine compiles prefill, is predicted over the target
(`slack_guard_ms`): in those 0.6B runs 512-1,024-row compiled steps fit, while on 8B 4-bit (the thirtieth run's steps
replayed through the cost model) at most 384 rows fit a 20 ms target, 128-192 typically, so its slack is unchanged. The
floor step itself is now priced compiled where the engine compiles prefill (`slack_allowance_ms`): its eager price swung
with which shapes had traces.

Where the engine runs some shapes through compiled traces (`traced_shapes.py`), each candidate is predicted in
the form it would run now, and the largest candidate turned down only for want of a trace (over the target eager,
within it compiled) is the decision's `wanted`: the scheduler asks the engine to trace it.

The row-tile fill crosses a bucket whenever the halved budget is one (8 lanes, 64-row tiles: 256 -> 384 rows, 512 ->
768): `checked_fill` "on" (default) keeps a fill past the budget's own query bucket only where the grown step is
predicted within what it may take, "untraced" also where it keeps the budget's compiled trace (reason `+bucket` where
it was held), "off" always. H200, 8B 4-bit (twenty-ninth run): unchecked, a 512-row budget predicted within a ~31 ms
allowance ran as 768 rows, eager, 67.9 ms, the run's longest gap. Checked and with the engine's floor slack at 1.75
(thirtieth run), the shape ran 512-row chunks in 4 of 4 runs with both contended targets met; only quantized models
on CUDA fill row tiles, so the other shapes are unchanged.

A budget planned only to the target can leave a long prompt's prefill far slower than it runs alone: a step's fixed
cost (its decode lanes' GEMVs, weight reads, launches) is spread over few rows. With `max_prefill_slowdown` a
contended chunk grows one query bucket at a time while its predicted cost a row is over that multiple of a
ceiling-sized uncontended chunk's at the same history (`grow_for_rate`, reason `+rate`), never to a step predicted
over `RATE_GROWTH_CAP` x what it may take; such a step's streams are not in decode debt within that cap. Off by
default: on the H200 at 1.3 (twenty-eighth run) the 16k prompt's TTFT beside 8 streams fell from 1.57x solo to 1.15x
(8B 4-bit), 1.41x to 1.30x (8B) and ~1.47x to 1.32x (30B-A3B), but with fewer, larger mixed steps the streams'
median gap became a decode step's, and the max gap / median rose to 9.4 (8B 4-bit) and 4.2 (30B-A3B) against 3.

Two narrower midpoints were measured and dropped: one taken only where it keeps the halved step's compiled trace
(H200, thirty-first run: no eager midpoint held a longest gap, yet the gap ratio was 2.92-4.13 on against 2.86-3.74
off), and one only where the wider step's shape has run before (H100, forty-first run: 0 of 3 gaps met either way).

The prediction changes only which budget is chosen: the order of the lanes and who is admitted are decided
elsewhere and never look at it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from scheduler.buckets import query_bucket
from scheduler.config import SchedulerConfig
from scheduler.cost_models import MIN_TRAINING_ROWS, CostModel, PrefillChunk, StepShape
from scheduler.first_runs import SWAP_LEAST_SHARE
from scheduler.traced_shapes import StandIn

# the floor slack applies only where the floor step is predicted at most this far over the target, or steps doing no
# more work were measured over it: far over it unmeasured, the fit is more likely still wrong (H200, 8B 4-bit: a first
# contended step planned by a fresh fit grew to 1,536 rows, 62 ms against a 30 ms target)
SLACK_WITHIN = 1.5
# a chunk grown for its prefill rate (`grow_for_rate`) is predicted at most this multiple of what the step may take:
# past it, the streams' gaps, not the prompt's rate, are what users see
RATE_GROWTH_CAP = 2.0


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    row_budget: int  # prefill rows the step may carry
    # "uncontended", "contended", "contended-untrained", "halved:<n>[+half]" (contended ones end in "+bucket" where
    # `checked_fill` held the row-tile fill to the budget's bucket, "+first-run" where `price_first_runs` gave way to a
    # smaller shape that has run, "+slack" where the floor slack raised the target: `slack_allowance_ms`, then "+rate"
    # where `grow_for_rate` grew it, "+stand-in" where `fill_stand_in` did), "decode-debt"
    reason: str
    halvings: int
    predicted_ms: float | None  # the cost model's prediction for the planned prefill at this budget
    wanted: tuple[PrefillChunk, ...] = ()  # a larger step's chunks that would fit the target with a compiled trace
    limit_ms: float | None = None  # what a contended step was planned to take at most (None: uncontended, debt)


def fill_shortest_first(demand: Sequence[PrefillChunk], budget: int) -> tuple[PrefillChunk, ...]:
    """Chunks in the given order until the budget is spent; the last one is cut to fit."""
    chunks = []
    left = budget
    for wanted in demand:
        if left <= 0:
            break
        rows = min(wanted.rows, left)
        if rows > 0:
            chunks.append(PrefillChunk(rows=rows, history=wanted.history))
            left -= rows
    return tuple(chunks)


def choose_row_budget(
    config: SchedulerConfig,
    model: CostModel,
    demand: Sequence[PrefillChunk],
    decode_lanes: int,
    in_debt: bool,
    contended: bool,
    target_ms: float,
    traced: Callable[[Sequence[PrefillChunk]], bool] | None = None,
    allowance_ms: float | None = None,
    met: Callable[[Sequence[PrefillChunk]], bool] | None = None,
    first_run_ms: float = 0.0,
    stand_in_ms: Callable[[Sequence[PrefillChunk], float], float | None] | None = None,
) -> BudgetDecision:
    """The prefill row budget for a step whose ordered prefill demand is `demand`, against `target_ms` (the
    scheduler's `StepTarget`: fixed, or a multiple of the measured decode step) or, where the floor slack allows
    more, `allowance_ms` (`slack_allowance_ms`; None: worked out here), less `config.plan_headroom`.
    `traced`: whether a step of these chunks would run compiled now (None: the engine compiles no prefill); `met`:
    whether such a step's shape has run before in that form (None: not known, a first run is never declined);
    `first_run_ms`: what a shape's first run costs over its price (`first_runs.py`; 0: not priced); `stand_in_ms`:
    where a step of these chunks has no trace of its own and would replay a larger one planned to take at most the
    given ms, that trace's last run (None: not priced so)."""
    if allowance_ms is None and contended and not in_debt:
        allowance_ms = slack_allowance_ms(config, model, demand, decode_lanes, target_ms, traced)
    slack = allowance_ms is not None and allowance_ms > target_ms
    target_ms = (allowance_ms if slack else target_ms) * config.plan_headroom
    search = _BudgetSearch(model, demand, decode_lanes, target_ms, traced, met, stand_in_ms)
    budget = config.row_ceiling
    if not contended:
        return BudgetDecision(budget, "uncontended", 0, search.predict(budget))  # no target: nothing wanted
    if in_debt:
        return BudgetDecision(0, "decode-debt", 0, None)
    halvings = 0
    predicted = search.predict(budget)
    while predicted is not None and predicted > target_ms and budget > config.row_floor:
        budget = max(config.row_floor, budget // 2)
        halvings += 1
        predicted = search.predict(budget)
    if predicted is None and config.untrained_rows:  # nothing to price by yet: a modest step, large enough to train on
        budget = min(budget, max(config.row_floor, MIN_TRAINING_ROWS, config.untrained_rows))
    budget, predicted, held = fill_paid_rows(config, budget, predicted, decode_lanes, target_ms, search.predict,
                                             search.loses_trace)
    widened = False
    if halvings and config.budget_midpoints and predicted is not None and predicted <= target_ms:
        budget, predicted, widened = _widen_to_midpoint(config, search, budget, predicted)
    first_run = False
    if first_run_ms and predicted is not None and search.never_ran(budget) and predicted + first_run_ms > target_ms:
        budget, predicted, first_run = _decline_first_run(config, search, budget, predicted)
    grown = False
    if config.max_prefill_slowdown:
        budget, predicted, grown = grow_for_rate(config, model, demand, budget, predicted, target_ms, search.predict)
    if halvings:
        reason = f"halved:{halvings}" + ("+half" if widened else "")
    else:
        reason = "contended-untrained" if predicted is None and demand else "contended"
    reason += "+bucket" if held else ""
    reason += "+first-run" if first_run else ""
    reason += "+slack" if slack else ""
    reason += "+rate" if grown else ""
    # no want where the step got as many rows anyway (a tile or bucket grew it back)
    wanted = search.wanted if sum(chunk.rows for chunk in search.wanted) > budget else ()
    return BudgetDecision(budget, reason, halvings, predicted, wanted, target_ms)


@dataclass(slots=True)
class _BudgetSearch:
    """Prices the candidate budgets of one step's demand against its planned target, and remembers the largest
    candidate that runs eager over the target but would fit compiled (`BudgetDecision.wanted`)."""

    model: CostModel
    demand: Sequence[PrefillChunk]
    decode_lanes: int
    target_ms: float
    traced: Callable[[Sequence[PrefillChunk]], bool] | None
    met: Callable[[Sequence[PrefillChunk]], bool] | None
    stand_in_ms: Callable[[Sequence[PrefillChunk], float], float | None] | None
    wanted: tuple[PrefillChunk, ...] = ()

    def predict(self, budget: int) -> float | None:
        chunks = fill_shortest_first(self.demand, budget)
        if not chunks:
            return None
        compiled = self.traced is not None and self.traced(chunks)
        replayed_ms = None if self.stand_in_ms is None else self.stand_in_ms(chunks, self.target_ms)
        if replayed_ms is not None:
            predicted = replayed_ms  # a larger trace replays in its place: the step costs that trace's run
        else:
            predicted = self.model.predict(StepShape(chunks, self.decode_lanes, compiled=compiled))
        if (self.traced is not None and not compiled and not self.wanted and predicted is not None
                and predicted > self.target_ms):
            as_compiled = self.model.predict(StepShape(chunks, self.decode_lanes, compiled=True))
            if as_compiled is not None and as_compiled <= self.target_ms:
                self.wanted = chunks  # the first such candidate is the largest: budgets only shrink from here
        return predicted

    def runs_compiled(self, rows: int) -> bool:
        return self.traced is not None and self.traced(fill_shortest_first(self.demand, rows))

    def loses_trace(self, budget: int, grown: int) -> bool:
        """Whether growing `budget` to `grown` rows trades a step that replays a compiled trace for an eager one."""
        return self.runs_compiled(budget) and not self.runs_compiled(grown)

    def never_ran(self, rows: int) -> bool:
        """Whether a step of `rows` would be its shape's first run in its form (False where the engine cannot say)."""
        return self.met is not None and not self.met(fill_shortest_first(self.demand, rows))


def _widen_to_midpoint(
    config: SchedulerConfig, search: _BudgetSearch, budget: int, predicted: float
) -> tuple[int, float, bool]:
    """A halved budget that fits grows by half again (as the engine pays for rows) where that fits too."""
    wider = paid_rows(budget + budget // 2, search.decode_lanes, config)
    wider_predicted = search.predict(wider) if wider > budget else None
    if wider_predicted is not None and wider_predicted <= search.target_ms:
        return wider, wider_predicted, True
    return budget, predicted, False


def _decline_first_run(
    config: SchedulerConfig, search: _BudgetSearch, budget: int, predicted: float
) -> tuple[int, float, bool]:
    """The budget's shape would run for the first time and overrun with its one-off work: the largest smaller
    budget whose shape has run and fits is taken instead, and the declined shape traced when next idle."""
    asked = search.wanted  # what pricing the smaller candidates may ask for is not the declined shape
    smaller = _met_budget_below(config, search.demand, budget, search.decode_lanes, search.target_ms, search.predict,
                                search.never_ran)
    if smaller is None:
        return budget, predicted, False
    search.wanted = asked or fill_shortest_first(search.demand, budget)
    return *smaller, True


def fill_stand_in(
    decision: BudgetDecision, demand: Sequence[PrefillChunk], stand_in: Callable[[Sequence[PrefillChunk]], StandIn | None]
) -> BudgetDecision:
    """`decision` grown to the rows a larger trace carries where its step would replay that trace in place of its
    own untraced shape (`stand_in`): the step costs the trace's run whatever rows it carries, so its pad rows may as
    well be the prompt's. Only a step of one chunk stands in, so the growth stays within that chunk's demand; the
    prediction becomes the trace's last run (reason `+stand-in`)."""
    chunks = fill_shortest_first(demand, decision.row_budget)
    if len(chunks) != 1 or decision.limit_ms is None:
        return decision
    carried = stand_in(chunks)
    rows = 0 if carried is None else min(carried.rows, demand[0].rows)
    if rows <= decision.row_budget:
        return decision
    predicted = decision.predicted_ms if carried.last_run_ms is None else carried.last_run_ms
    return replace(decision, row_budget=rows, reason=decision.reason + "+stand-in", predicted_ms=predicted)


def _met_budget_below(
    config: SchedulerConfig,
    demand: Sequence[PrefillChunk],
    budget: int,
    decode_lanes: int,
    limit_ms: float,
    predict: Callable[[int], float | None],
    never_ran: Callable[[int], bool],
) -> tuple[int, float] | None:
    """The largest budget under `budget` on the halving ladder (halvings of the ceiling and their midpoints, as the
    engine pays for them) whose step reads fewer rows, has run in its form and is predicted within `limit_ms`; None:
    there is none (then the first run is paid rather than spiralling onto ever smaller new shapes). One reading under
    `SWAP_LEAST_SHARE` of the rows `budget` reads is no candidate: the declined shape stays unmet while the engine is
    busy, so the swap repeats every step of its history bucket (H100: 16 steps of 64 rows for one of 1,024)."""
    rows_now = sum(chunk.rows for chunk in fill_shortest_first(demand, budget))
    ladder, step = set(), config.row_ceiling
    while step >= config.row_floor:
        ladder.update({step, step + step // 2})
        step //= 2
    for rows in sorted({paid_rows(r, decode_lanes, config) for r in ladder}, reverse=True):
        if rows >= budget or rows < config.row_floor:
            continue
        read = sum(chunk.rows for chunk in fill_shortest_first(demand, rows))
        if read < rows_now * SWAP_LEAST_SHARE:
            return None  # smaller still: more steps' fixed cost than the one-off work saved
        if read >= rows_now or never_ran(rows):
            continue
        predicted = predict(rows)
        if predicted is not None and predicted <= limit_ms:
            return rows, predicted
    return None


def fill_paid_rows(
    config: SchedulerConfig,
    budget: int,
    predicted: float | None,
    decode_lanes: int,
    limit_ms: float,
    predict: Callable[[int], float | None],
    loses_trace: Callable[[int, int], bool],
) -> tuple[int, float | None, bool]:
    """`budget` grown to the rows the engine pays for anyway (`paid_rows`). A halved budget is a query bucket, so
    filling its last row tile with the decode lanes' rows crosses into the next bucket (8 lanes: 256 -> 384 rows,
    512 -> 768). `config.checked_fill` "on" keeps that growth only where the grown step is predicted within
    `limit_ms`; "untraced" only where it is so predicted or keeps the compiled trace the budget's own step replays
    (`loses_trace`: the filled step would run eager where the budget's own replays a trace); otherwise the budget
    fills its tile only as far as its own bucket. Returns the budget, its prediction and whether the fill was held to
    the bucket."""
    filled = paid_rows(budget, decode_lanes, config)
    if filled == budget:
        return budget, predicted, False
    filled_predicted = predict(filled)
    crosses = config.kv_bucket and filled > query_bucket(budget) and budget > 0
    if config.checked_fill == "off" or not crosses or (filled_predicted is not None and filled_predicted <= limit_ms):
        return filled, filled_predicted, False
    if config.checked_fill == "untraced" and not loses_trace(budget, filled):
        return filled, filled_predicted, False
    within = min(fill_row_tile(budget, decode_lanes, config.row_quantum, config.row_ceiling), query_bucket(budget))
    return within, (predicted if within == budget else predict(within)), True


def grow_for_rate(
    config: SchedulerConfig,
    model: CostModel,
    demand: Sequence[PrefillChunk],
    budget: int,
    predicted: float | None,
    limit_ms: float,
    predict: Callable[[int], float | None],
) -> tuple[int, float | None, bool]:
    """`budget` grown to the next query bucket while the step is predicted at more than
    `config.max_prefill_slowdown` x a ceiling-sized uncontended chunk's cost a row at the same history for the rows
    it carries, each larger step predicted within `RATE_GROWTH_CAP` x `limit_ms` (what the step may take).
    Returns the budget, its prediction and whether it grew."""
    reference = fill_shortest_first(demand, config.row_ceiling)
    solo_ms = model.predict(StepShape(reference, 0)) if reference else None
    if predicted is None or solo_ms is None or not 0 < solo_ms < math.inf:
        return budget, predicted, False
    per_row_ms = config.max_prefill_slowdown * solo_ms / sum(chunk.rows for chunk in reference)
    wanted_rows = sum(chunk.rows for chunk in demand)
    grown = False
    while budget < min(config.row_ceiling, wanted_rows) and predicted > per_row_ms * budget:
        bigger = min(query_bucket(budget + 1), config.row_ceiling)
        bigger_predicted = predict(bigger)
        if bigger_predicted is None or bigger_predicted > RATE_GROWTH_CAP * limit_ms:
            break
        budget, predicted, grown = bigger, bigger_predicted, True
    return budget, predicted, grown


def paid_rows(budget: int, decode_lanes: int, config: SchedulerConfig) -> int:
    """`budget` grown to the rows the engine runs anyway: its last row tile (`fill_row_tile`), then, where the
    engine pads chunks to query buckets, the bucket that tile-filled budget is padded to."""
    filled = fill_row_tile(budget, decode_lanes, config.row_quantum, config.row_ceiling)
    if not config.kv_bucket or filled <= 0:
        return filled
    return min(query_bucket(filled), config.row_ceiling)


def fill_row_tile(budget: int, decode_lanes: int, quantum: int, ceiling: int) -> int:
    """`budget` grown so the step's rows (decode lanes + prefill) end on a multiple of `quantum`, never past the
    ceiling and never below `budget`: e.g. 8 lanes + 64 rows run two 64-row tiles, so the budget becomes 120. It
    overrides the prediction by design: at most a tile's rows more than the halving chose."""
    if quantum <= 1 or budget <= 0:
        return budget
    rows = -(-(budget + decode_lanes) // quantum) * quantum
    return max(budget, min(rows, ceiling) - decode_lanes)


def slack_allowance_ms(
    config: SchedulerConfig,
    model: CostModel,
    demand: Sequence[PrefillChunk],
    decode_lanes: int,
    target_ms: float,
    traced: Callable[[Sequence[PrefillChunk]], bool] | None = None,
) -> float:
    """What a contended step may take: the target, or `config.floor_slack` times the floor step's prediction where
    that is more and the floor step is predicted at most `SLACK_WITHIN` times the target (far over it, the fit is
    more likely wrong) or steps doing no more work were measured over the planned target (`floor_measured_over`).
    The budget plans to it, and a stream is in decode debt only past it: where a step's fixed cost fills the target, a
    debt step cannot bring the next contended step under the target, it only delays the prompt (H200, 8B 4-bit: 77 debt
    steps beside 74 mixed ones, 0.4 s of a 2.1 s TTFT). Not where a step of `config.slack_guard_rows` rows fits the
    target in its cheaper form (`slack_guard_ms`), and never past that step's price: the slack is for a fixed cost that
    fills the target, which that many rows spread already.

    The floor step is priced compiled where the engine compiles prefill: the fixed cost the slack is for, not the
    host build of a shape not traced yet. Priced as it would run, the allowance swung with which shapes had traces:
    H100, 8B 4-bit beside 8 streams (forty-sixth run), the floor's 128 rows eager rose past `SLACK_WITHIN` x a 16 ms
    target as the prompt's history grew (25 ms; 18 compiled), the slack went off mid-prompt and 169 steps of 64 rows
    read the rest (TTFT 3.8x solo)."""
    if config.floor_slack <= 1 or not demand:
        return target_ms
    planned = target_ms * config.plan_headroom  # what budgets are planned to: the floor is compared with it
    guard_ms = slack_guard_ms(config, model, demand, decode_lanes, traced)
    if guard_ms is not None and guard_ms <= planned:  # the target admits many rows: the slack is not for this step
        return target_ms
    floor_ms = floor_step_ms(config, model, demand, decode_lanes, traced)
    if floor_ms is None or floor_ms <= 0:
        return target_ms
    if floor_ms > SLACK_WITHIN * planned and not floor_measured_over(config, model, demand, decode_lanes, planned):
        return target_ms
    slack_ms = config.floor_slack * floor_ms
    if guard_ms is not None:  # the slack buys at most the guard's rows: past them the fixed cost is spread already
        slack_ms = min(slack_ms, guard_ms)
    return max(target_ms, slack_ms / config.plan_headroom)


def floor_step_ms(
    config: SchedulerConfig, model: CostModel, demand: Sequence[PrefillChunk], decode_lanes: int,
    traced: Callable[[Sequence[PrefillChunk]], bool] | None,
) -> float | None:  # fmt: skip
    """The floor step's price, what the floor slack scales: its rows (`floor_step_rows`) beside `decode_lanes`,
    compiled where the engine compiles prefill."""
    rows = floor_step_rows(config, decode_lanes)
    return predict_compiled_where_prefill_compiles(model, demand, rows, decode_lanes, traced)


def floor_step_rows(config: SchedulerConfig, decode_lanes: int) -> int:
    """The floor step's prefill rows: `config.row_floor`, their row tile filled (`paid_rows`)."""
    return paid_rows(config.row_floor, decode_lanes, config)


def floor_measured_over(
    config: SchedulerConfig, model: CostModel, demand: Sequence[PrefillChunk], decode_lanes: int, limit_ms: float
) -> bool:
    """Whether the largest remembered steps doing no more work than the floor step, in either form, typically took
    more than `limit_ms` (`CostModel.measured_floor_ms`): the floor's price is then measured, not a fit's guess."""
    chunks = fill_shortest_first(demand, floor_step_rows(config, decode_lanes))
    measured = model.measured_floor_ms(StepShape(chunks, decode_lanes)) if chunks else None
    return measured is not None and measured > limit_ms


def slack_guard_ms(
    config: SchedulerConfig, model: CostModel, demand: Sequence[PrefillChunk], decode_lanes: int,
    traced: Callable[[Sequence[PrefillChunk]], bool] | None,
) -> float | None:  # fmt: skip
    """The price of the slack guard's step (`config.slack_guard_rows` of the demand's rows, compiled where the engine
    compiles prefill); None without a guard."""
    if not config.slack_guard_rows:
        return None
    return predict_compiled_where_prefill_compiles(model, demand, config.slack_guard_rows, decode_lanes, traced)


def predict_compiled_where_prefill_compiles(
    model: CostModel,
    demand: Sequence[PrefillChunk],
    rows: int,
    decode_lanes: int,
    traced: Callable[[Sequence[PrefillChunk]], bool] | None,
) -> float | None:
    """The predicted time of a step of `rows` of the demand's rows beside `decode_lanes`, priced compiled wherever
    the engine compiles prefill (`traced` given), whether or not that shape has a trace yet (None: no rows)."""
    chunks = fill_shortest_first(demand, rows)
    return model.predict(StepShape(chunks, decode_lanes, compiled=traced is not None)) if chunks else None


def stream_in_debt(waited_s: float, last_gap_s: float | None, target_ms: float) -> bool:
    """A stream is in debt when it has waited, or its last inter-token gap lasted, longer than the target.

    The scheduler passes the last gap only when the step that ended it carried prefill rows (a slow decode-only
    step is not fixed by dropping prefill), and never makes two debt steps in a row, so prefill cannot starve:
    at worst every other contended step carries prefill rows.
    """
    limit_s = target_ms / 1000.0
    return waited_s > limit_s or (last_gap_s is not None and last_gap_s > limit_s)
