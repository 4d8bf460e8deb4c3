"""What the engine runs through compiled traces, as the scheduler sees it (no MLX: plain shapes in, bools out).

On CUDA a contended step of decode lanes and one prefill chunk replays an `mx.compile` trace of its padded shape,
and a shape met for the first time runs eager until the engine, when quiet, traces it. The two forms cost very
differently where the host bounds the step (H200, Qwen3-0.6B: eager ~13 ms for 512 rows, compiled 1,024 rows in
11-18 ms), so a budget planned with one form's cost and run in the other misses its target, and a cost model that
learns both as one drifts: eager steps of new shapes taught it eager costs, it shrank the budgets onto more new
shapes (twentieth run, 0.6B at factor 2.75: 28 of 51 contended steps on shapes the warm pass never met, TTFT 3.8x).

So the budget asks, for each candidate, whether that step would run compiled now and predicts that form; and when
a larger candidate would have fitted the target as a compiled step but has no trace yet, it asks the engine to
trace that shape when quiet, so the next contended read gets the budget it wanted.

A step with no trace of its own may replay a larger trace in its place, padded (a stand-in): its time is that
trace's, whatever rows it carries. So where the budget's step would stand in, it grows to the rows the stand-in
carries (`budget.fill_stand_in`): H100, 0.6B beside 8 streams (fifty-first run), a 16k prompt read in 64-128-row
chunks priced eager (~10 ms) that stood in for a 384-512-row trace (~7-9 ms): TTFT 3.85x solo.

The engine may also replay a stand-in slower than the step's limit (one within the time an eager build of the step
would take), so with `price_stand_in_runs` a budget whose step would stand in is priced at the run of the trace it
would replay (`stand_in_run_ms`): H100, 30B-A3B beside 8 streams (fifty-seventh run), every missed gap was a
1,024-row step priced eager at 58-66 ms against a 67 ms limit that replayed a 68-72 ms trace and took 72-79 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.cost_models import PrefillChunk
    from scheduler.plan import Lane


@dataclass(frozen=True, slots=True)
class StandIn:
    """A larger trace a step would replay in place of its own untraced shape."""

    rows: int  # the most rows the step's chunk could carry through it at the same cost
    last_run_ms: float | None  # that trace's last ordinary run (None: not yet timed)


class TracedShapes(Protocol):
    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        """Whether a GPU step of these prefill chunks beside these decode lanes would run compiled now."""
        ...

    def met(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        """Whether that step's shape has run before in the form it would run now (a shape's first run, traced or
        eager, pays one-off work); True where the engine cannot tell."""
        ...

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> None:
        """Ask for a trace of that step's shape (the engine traces it when quiet; ignored if it cannot)."""
        ...

    def stand_in(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float | None) -> StandIn | None:
        """Where that step would replay a larger trace in place of its own (`limit_ms`: what it may take), what
        that trace carries; None where it would not."""
        ...

    def stand_in_run_ms(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float) -> float | None:
        """Where that step has no trace of its own and the engine would replay a larger one in its place (planned
        to take at most `limit_ms`), that trace's last run (ms); None where it would not, or that run is not timed."""
        ...
