"""A contended step's target paced by the long prompt it reads (`SchedulerConfig.paced_slowdown`).

The streams' gap wants short contended steps; the long prompt's TTFT wants few of them. A fixed factor of the decode
step cannot serve both on every model: on an H100, Qwen3-0.6B's steps of 3 decode steps overran the gap limit (3
median gaps) in 6 of 6 runs while its prompt read at 1.1-1.3x solo, and 30B-A3B's read at 1.32-1.52x solo at that
factor with no room to lower it (RESULTS, forty-first run: the gap frontier). Paced, the target starts from the
configured factor (2.5, say) and rises a quarter at a time, to `paced_factor_cap`, until the leading prompt's
predicted read, chunk by chunk at that target, is within `paced_slowdown` x its predicted read alone in ceiling-sized
chunks. A contended step is never priced under a decode step: the affine fit, trained on wide chunks, prices a
64-row step beside 8 streams at a third of one.

The cost model trains on contended steps only, so its price of a read alone is an extrapolation to steps without
decode lanes (on an H100, 0.6B's solo 2,048-row steps ran ~16 ms against ~7 ms of the contended price's row and
pair parts). So the read alone is the model's eager price times the median measured / priced ratio of the last
uncontended prefill steps the scheduler saw (`ALONE_MEMORY`, each of `ALONE_MIN_ROWS` or more); 1 before any.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from scheduler.buckets import query_buckets
from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.learning import step_shapes
from scheduler.plan import Path, StepOutcome, StepPlan

PACE_STEP = 0.25  # the factor ladder's step
PACE_REFRESH_ROWS = 1024  # a prompt's pace is worked out again once it has read this many more rows
ALONE_MEMORY = 16  # the uncontended prefill steps whose measured / priced ratio calibrates the read alone
ALONE_MIN_ROWS = 256  # narrower steps say more about a step's fixed cost than about a read's

# (rows, history) -> predicted ms, None where the model cannot say
Price = Callable[[int, int], float | None]


def read_steps(price: Price, rows: int, history: int, limit_ms: float, ceiling: int) -> list[tuple[int, float]] | None:
    """The steps, (rows, predicted ms), that read `rows` prompt rows from `history`, each the widest query bucket (at
    most `ceiling` rows, or the rows left) priced within `limit_ms`; None where even the narrowest is not, or a price
    is unknown. A step costs more the longer the history, so the widest fitting bucket only narrows as the read goes."""
    buckets = query_buckets(ceiling)
    index, done, steps = len(buckets) - 1, 0, []
    while done < rows:
        left = rows - done
        if index + 1 < len(buckets) and left < min(buckets[index + 1], ceiling):
            # the rest is narrower than the narrowest width refused: it may fit whole
            cost = price(left, history + done)
            if cost is None:
                return None
            if cost <= limit_ms:
                steps.append((left, cost))
                break
        while index >= 0:
            take = min(buckets[index], ceiling, left)
            cost = price(take, history + done)
            if cost is None:
                return None
            if cost <= limit_ms:
                break
            index -= 1
        if index < 0:
            return None
        steps.append((take, cost))
        done += take
    return steps


def read_ms(price: Price, rows: int, history: int, limit_ms: float, ceiling: int) -> float | None:
    """`read_steps`' predicted time in all."""
    steps = read_steps(price, rows, history, limit_ms, ceiling)
    return None if steps is None else sum(cost for _, cost in steps)


def solo_ms(price: Price, rows: int, history: int, ceiling: int) -> float | None:
    """The predicted time to read `rows` prompt rows from `history` alone, in ceiling-sized chunks."""
    total, done = 0.0, 0
    while done < rows:
        take = min(ceiling, rows - done)
        cost = price(take, history + done)
        if cost is None:
            return None
        total, done = total + cost, done + take
    return total


def paced_target_ms(
    chunk: PrefillChunk,
    left_ms: float,
    decode_step_ms: float,
    factor: float,
    cap: float,
    floor_ms: float,
    contended: Price,
    ceiling: int,
) -> float:
    """The least target max(`floor_ms`, f x `decode_step_ms`), f from `factor` up to `cap` by `PACE_STEP`, under
    which `chunk` (the prompt's rows left, at their history) is predicted read within `left_ms`; the cap's target
    where none is."""
    top = max(cap, factor)
    step = 0
    while (f := factor + step * PACE_STEP) < top:
        target = max(floor_ms, f * decode_step_ms)
        paced = read_ms(contended, chunk.rows, chunk.history, target, ceiling)
        if paced is not None and paced <= left_ms:
            return target
        step += 1
    return max(floor_ms, top * decode_step_ms)


class PromptPace:
    """The paced target of the scheduler's leading prompt. Its TTFT may be `slowdown` x its predicted read alone
    (from its first uncached row, worked out once); what is left of that after the time since its arrival is what its
    remaining rows may take. Worked out again only where the decode step, the lanes or the leading prompt changed, or
    it has read `PACE_REFRESH_ROWS` more rows."""

    def __init__(self) -> None:
        self._allowed: tuple[str, float] | None = None  # (request, its predicted TTFT allowance, ms)
        self._alone: deque[tuple[StepShape, float]] = deque(maxlen=ALONE_MEMORY)  # uncontended steps, measured ms
        self._key: tuple | None = None
        self._target_ms = 0.0
        self.worked_out = 0  # how many times a target was worked out (for tests and status)

    def allowed_ms(self, request_id: str, work: Callable[[], float | None]) -> float | None:
        """The prompt's TTFT allowance, worked out once it can be priced (None until then: asked again next step)."""
        if self._allowed is None or self._allowed[0] != request_id:
            allowed = work()
            if allowed is None:
                return None
            self._allowed = (request_id, allowed)
        return self._allowed[1]

    def target_ms(self, request_id: str, history: int, decode_step_ms: float, lanes: int, work: Callable[[], float]) -> float:
        key = (request_id, round(decode_step_ms, 2), lanes, history // PACE_REFRESH_ROWS)
        if key != self._key:
            self._key, self._target_ms = key, work()
            self.worked_out += 1
        return self._target_ms

    def observe_alone(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Keep an uncontended prefill step's shape and measured time (GPU lanes, no decode lanes, wide enough)."""
        elapsed = outcome.elapsed_ms
        if plan.contended or outcome.failed or outcome.auxiliary or not isinstance(elapsed, float | int):
            return
        shape = step_shapes(plan.lanes).get(Path.GPU)
        if shape is None or shape.decode_lanes or shape.prefill_rows < ALONE_MIN_ROWS:
            return
        if math.isfinite(elapsed) and elapsed > 0:
            self._alone.append((shape, float(elapsed)))

    def alone_scale(self, predict: Callable[[StepShape], float | None]) -> float:
        """The median measured / priced ratio of the kept uncontended steps, each priced eager (1 before any)."""
        ratios = []
        for shape, elapsed in self._alone:
            priced = predict(replace(shape, compiled=False))
            if priced is not None and math.isfinite(priced) and priced > 0:
                ratios.append(elapsed / priced)
        return statistics.median(ratios) if ratios else 1.0
