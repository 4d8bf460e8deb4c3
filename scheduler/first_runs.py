"""What a contended step pays over its price when its shape runs for the first time (`price_first_runs`).

A shape's first run, eager or traced, carries one-off work (cuDNN graphs, NVRTC kernels, a trace) that the cost model
never learns: such steps are `auxiliary` and train nothing, and flagged `first_run` (unlike other one-off steps: a stand-in,
a KV copy, a scored step). On an H100 (forty-third run, Qwen3-0.6B beside 8 streams
at an 11 ms target) they were 4-6 steps a pass, mostly in the long prompt's first 4k tokens, the first eager runs
over their prices by a median of -0.9 to +4.4 ms a run and up to +7.2 ms; they held the longest gap, while without
them the slowest step was within 3 median gaps in 6 of 7 runs.

So where the chosen budget's shape has not run in the form it would run (`TracedShapes.met`) and its price plus what
such steps measured over their prices (the median of the last few, never below 0) is over the target, the planner
takes the largest smaller budget, down to half its rows, whose shape has run and fits (`budget.choose_row_budget`, reason
`+first-run`). On the H100 (forty-fourth run) a swap without that bound read a prompt's first 1,024 tokens in 16
steps of 64 rows, which cost TTFT (1.65x).
"""

from __future__ import annotations

import statistics
from collections import deque

from scheduler.plan import StepOutcome, StepPlan

FIRST_RUNS_KEPT = 16  # the last first runs remembered: one long prompt's start meets 4-6
FIRST_RUNS_LEAST = 3  # fewer seen: no price (one sample is one shape's build, not a host's)
# the least share of a declined budget's rows a swap keeps: one declined shape stays unmet while the engine is busy
# (it is traced when idle), so its swap repeats each step until the history bucket moves on
SWAP_LEAST_SHARE = 0.5


class FirstRunPrice:
    """Learns from contended steps flagged first runs (`StepOutcome.first_run`) how far over their price they ran."""

    def __init__(self, kept: int = FIRST_RUNS_KEPT, least: int = FIRST_RUNS_LEAST) -> None:
        self._over: deque[float] = deque(maxlen=kept)
        self._least = least

    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """A measured step: remembered where it was contended, had prefill, was its shape's first run in its form
        and was priced. Other one-off steps are not first runs: a stand-in priced at its trace's run ran 10-25 ms
        under that price at short histories (H100, 30B-A3B), which held the median under 0 and the price off."""
        if not (plan.contended and plan.prefill_rows and outcome.first_run) or outcome.failed:
            return
        if plan.predicted_ms is None or not outcome.elapsed_ms >= 0:  # NaN: a step left in flight, timed later
            return
        self._over.append(outcome.elapsed_ms - plan.predicted_ms)

    @property
    def extra_ms(self) -> float:
        """What a first run is priced over the model's price: the median excess seen, 0 until enough are seen."""
        if len(self._over) < self._least:
            return 0.0
        return max(0.0, statistics.median(self._over))
