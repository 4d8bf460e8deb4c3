"""The optional `affine` prefill cost model: fixed + per-row + per-attention-pair + per-decode-lane + per-extra-
prefill-lane milliseconds.

attention pairs = sum over the prefill lanes of rows x (history + rows / 2). Where the engine pads GPU chunks
(`kv_bucket` > 0, CUDA) the work it runs is counted instead: each lane's rows are its query bucket and its pairs
that bucket x its padded KV length (the masked rectangle cuDNN computes). Exact counts missed the jumps at bucket
edges: on the H200 a 0.6B chunk of 1,536 rows took 17-18 ms at an 8k KV bucket, 23 at 12k and 28.5 at 16k while the
exact count grew by a fifth, and the 1,552-row last chunk of a 16k prompt ran as 2,048 rows (31 ms, 25.8 predicted).
Extra prefill lanes (a step's width past one) run outside the one-chunk compiled step, each with its own gather and
attention a layer: a 4-prompt start-up step of 1,920 rows took 33 ms against 16.6 predicted without this term.

A sixth feature is 1 for a step that replays a compiled trace (`StepShape.compiled`): the same GPU work without
building its graph on the host, so the forms share the slopes and differ by a fixed cost (on the H200 an eager
Qwen3-0.6B step has ~12 ms of host submission, `scheduler/traced_shapes.py`). Fits of their own per form were
tried first (twentieth run): where every compiled step had 64 rows, the compiled fit put that cost on its rows
slope, priced 1,024 compiled rows far over the target and never asked for their trace (0.6B stuck at 64-row steps,
TTFT 9.1x); shared slopes are learned from every step of either form.

One fit per path: least squares with forgetting (0.995: roughly the last 200 steps matter), so it tracks drift,
from the forgotten normal equations (fixed memory), with each coefficient held to its sign (`SIGNS`): rows, pairs
and lanes cost time, a trace saves some. Unconstrained (recursive least squares until the twenty-fourth run), a fit
of 0.6B's contended steps, all with 8 decode lanes and 384-768 rows, put 66 ms on the fixed cost, -7.5 ms on a
thousand rows and -6.4 ms on a lane: fixed cost, lanes and rows were one direction it split at will, and it priced
2,040 rows over no history at 6-8 ms (they ran 32-37). A direction the samples never excite (the width, while every
step has one chunk) stays at 0. Until a path's fit has 8 samples, or if its prediction is not a positive finite
number, it answers exactly as the `ema` baseline it trains alongside (until a compiled step is seen, a compiled one
is predicted as eager). Same training filter as the other models.

A least-squares fit has no defence against one wild sample, such as a step that stalled on a first-use compile
(H200, 8B 4-bit: a skewed fit predicted 120-row steps of 15 ms at 40-130 ms for a hundred steps, while a fresh fit
of the same steps predicted them within a few ms). So a fitted path trains on the measured time bounded to within
`OUTLIER_FACTOR` of its own prediction: one such sample moves the fit a bounded way, and a lasting change of cost
is still learned. On the GPU path the `ema` baseline's prediction widens that range (whichever allows more) and
bounds the samples before the fit answers: 2 s first-use kernel builds among a 4-bit run's first steps made its fit
predict 0.4 to 2,863 ms for the rest of that pass, and a fit predicting far too little capped every true sample
at 3x its own error (twenty-first run; replayed with this rule, that pass's mean error 161% -> 6%).

An affine fit also extrapolates: trained on steps up to 1,024 rows, where a fixed cost is spread over few rows, it
priced a 2,040-row 0.6B step at 21.3 ms that ran 31.8 (H200, twentieth run), and 768-row 4-bit steps at 19.7 that
ran 32. So a fitted prediction has a trust region (`TrustRegion`): a step of more than `trust_factor` times the
rows of the largest step recently trained on at a KV reach at least as long (where none reached as far: of those
that reached farthest) is priced at least at that step's cost per row. Growing one query bucket at a time (512 ->
768 -> 1,024) stays inside it, and so does growing a small step by `LEAST_GROWTH_ROWS` (64 -> 128 -> 256 rows).

The region has a floor too (`TrustRegion.floor_ms`): a step is priced at least at what the cheapest of the largest
remembered steps that did no more work took (no more rows, exact KV reach, decode lanes or chunks; a compiled step
against compiled ones only). A fit trained on steps over long histories puts their cost in the attention pairs and
prices a large chunk over no history at almost nothing: on the H200, 0.6B's first chunks of a long prompt, 1,024 to
2,040 rows beside 8 streams, were priced at 0.2-9 ms and ran 12-37 ms, the pass's longest gaps (twenty-third run).
The cheapest, not the dearest, so a stall among them sets nothing. Replayed over the twentieth to twenty-third runs'
steps: 8B 4-bit predictions more than 30% under the measured time 113 -> 54 (over: 153 -> 160), 0.6B 31 -> 30
(85 -> 95), 8B and 30B-A3B unchanged.

Optionally (`residual_weight` > 0, `SchedulerConfig.cost_residual_weight`) a prediction is corrected by what the
fitted model recently missed by on steps of its cell (`ResidualCorrection`): the path, the rows' query bucket, the
chunks, whether decode lanes rode along and the form. Rows are one slope in the fit, but the GPU does not price them
so: on the H100 8B 4-bit's 512-row steps beside 8 decode lanes ran in about the time of 384-row ones, and the fit,
right at 384 rows, priced 512 at 29.3-29.9 ms where they ran 23.8-28.6 (sixtieth run, f8q_1: the prompt read in
384-row chunks, TTFT 1.51x). Replayed over the fiftieth to sixtieth runs' steps with weight 0.3, the mean error
of the contended predictions read 8B 4-bit 4.9% -> 3.8% (512 rows: +4.5% -> +1.1% signed), 0.6B 10.8 -> 8.2, 8B
3.4 -> 3.0, 30B-A3B 5.6 -> 5.6 (`python -m benchmarks.gpu.replay_cost_model --by-rows --residual-weight 0.3`), and
the budgets chosen at f8q_1's states took 512 rows 31 times (7 without) with no more states over their allowance
(`replay_budgets --set cost_residual_weight=0.3`). On the H100 (sixty-first run) 8B 4-bit then read its 16k prompt
in 512-row chunks beside 8 streams, 1.36x and 1.39x its solo time against 1.45x and 1.49x without: 0.3 by default.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import NamedTuple

from scheduler.buckets import QUERY_BUCKET_MIN, history_bucket, query_bucket
from scheduler.cost_models import EmaCostModel, StepShape, is_trainable
from scheduler.plan import Path

FORGETTING = 0.995
MIN_SAMPLES = 8
# on the Gram matrix's diagonal: small against any excited direction's sum (features of order one, ~200 remembered
# steps), so it decides only the directions the samples never excited, and keeps those at 0
RIDGE = 1e-6
TOLERANCE = 1e-12
# rows in thousands, pairs in millions: features of order one. Where a direction is never excited (every step of one
# size), the fit splits the cost by the features' magnitudes; counted in single rows it put a fixed cost on the rows
# slope, priced twice the rows at twice the cost and never tried them (`tests/scheduler/test_traced_shapes.py`)
ROW_SCALE = 1e-3
PAIR_SCALE = 1e-6
OUTLIER_FACTOR = 3.0  # a fitted path trains on at most 3x (at least a third of) its prediction
TRUST_FACTOR = 1.5  # default `SchedulerConfig.cost_trust_factor`: rows past the largest recent step priced as fitted
TRUST_MEMORY = 200  # trained steps the trust region remembers per path (about what the forgetting keeps)
# the region reaches at least this many rows past its reference: beside decode lanes the engine's shapes from its
# smallest bucket are 64 -> 128 -> 256 rows (filled row tiles), 2x steps the factor never admits, and a small step's
# cost a row is mostly its fixed cost (H100, 8B 4-bit: 64 rows 15 ms, 768 rows 35; priced at 64's cost a row, every
# larger chunk of a 16k prompt read on at 64 rows a step, 169 steps)
LEAST_GROWTH_ROWS = 2 * QUERY_BUCKET_MIN
# a cell's correction stays within this fraction of the uncorrected prediction: it moves a price, never replaces it
RESIDUAL_BOUND = 0.3


FEATURES = 6
# each coefficient's sign: every feature is work that costs time, except that a trace saves the graph's building
SIGNS = (1, 1, 1, 1, 1, -1)


def _padded(shape: StepShape, kv_bucket: int) -> bool:
    return bool(kv_bucket) and shape.path is Path.GPU


def features(
    shape: StepShape, kv_bucket: int = 0, pads_history: bool = True
) -> tuple[float, float, float, float, float, float]:
    """(1, rows in thousands, attention pairs in millions, decode lanes, extra prefill lanes, compiled), padded as
    the engine pads: rows to query buckets, and the history to its bucket where the attention computes over it."""
    if _padded(shape, kv_bucket):
        rows = sum(query_bucket(c.rows) for c in shape.chunks)
        pairs = sum(
            query_bucket(c.rows)
            * (history_bucket(c.history + c.rows, kv_bucket) if pads_history else c.history + c.rows / 2)
            for c in shape.chunks
        )
    else:
        rows, pairs = shape.prefill_rows, shape.attention_pairs
    extra_lanes = max(shape.width - 1, 0)
    lanes, compiled = float(shape.decode_lanes), float(shape.compiled)
    return (1.0, rows * ROW_SCALE, pairs * PAIR_SCALE, lanes, float(extra_lanes), compiled)


class SignedLeastSquares:
    """theta minimising the exponentially forgotten squared error of y ~ theta . x, each coefficient held to its
    sign (`signs`: +1 at least 0, -1 at most 0, 0 free). The forgotten normal equations (x x' and x y, fixed
    memory) are kept and solved by an active set (Lawson-Hanson) when a prediction first needs the new theta."""

    def __init__(self, signs: tuple[int, ...], forgetting: float = FORGETTING) -> None:
        self.signs = signs
        self.forgetting = forgetting
        size = len(signs)
        self.gram = [[0.0] * size for _ in range(size)]
        self.moment = [0.0] * size
        self._theta = [0.0] * size
        self._stale = False
        self.samples = 0

    @property
    def theta(self) -> list[float]:
        if self._stale:
            self._theta = self._solve()
            self._stale = False
        return self._theta

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def observe(self, x: tuple[float, ...], y: float) -> None:
        keep = self.forgetting
        for i, xi in enumerate(x):
            self.moment[i] = keep * self.moment[i] + xi * y
            row = self.gram[i]
            for j, xj in enumerate(x):
                row[j] = keep * row[j] + xi * xj
        self.samples += 1
        self._stale = True

    def _solve(self) -> list[float]:
        """Lawson-Hanson on the normal equations, in coordinates where every constrained coefficient is >= 0 (a
        free one is never pinned). `RIDGE` on the diagonal: a direction the samples never excited stays at 0."""
        size = len(self.signs)
        flip = [-1.0 if sign < 0 else 1.0 for sign in self.signs]
        gram = [[flip[i] * flip[j] * self.gram[i][j] + (RIDGE if i == j else 0.0) for j in range(size)]
                for i in range(size)]  # fmt: skip
        moment = [flip[i] * self.moment[i] for i in range(size)]
        unconstrained = _solve_on(gram, moment, list(range(size)), size)
        if all(not sign or t >= 0.0 for sign, t in zip(self.signs, unconstrained, strict=True)):
            return [flip[i] * unconstrained[i] for i in range(size)]  # the optimum already: one elimination
        free = [i for i in range(size) if self.signs[i] == 0]
        theta = _solve_on(gram, moment, free, size) if free else [0.0] * size
        for _ in range(4 * size):  # Lawson-Hanson ends in at most a few passes of 6 unknowns; a bound all the same
            gradient = [moment[i] - sum(gram[i][j] * theta[j] for j in range(size)) for i in range(size)]
            pinned = [i for i in range(size) if i not in free]
            best = max(pinned, key=lambda i: gradient[i], default=None)
            if best is None or gradient[best] <= TOLERANCE * (1.0 + abs(moment[best])):
                break
            free.append(best)
            while True:
                trial = _solve_on(gram, moment, free, size)
                blocked = [i for i in free if self.signs[i] and trial[i] <= 0.0]
                if not blocked:
                    theta = trial
                    break
                step = min(theta[i] / (theta[i] - trial[i]) for i in blocked)
                theta = [t + step * (s - t) for t, s in zip(theta, trial, strict=True)]
                free = [i for i in free if not self.signs[i] or theta[i] > TOLERANCE]
                theta = [t if i in free else 0.0 for i, t in enumerate(theta)]
        return [flip[i] * theta[i] for i in range(size)]


def _solve_on(gram: list[list[float]], moment: list[float], free: list[int], size: int) -> list[float]:
    """The unconstrained least-squares solution over the `free` coefficients, the others 0 (Gaussian elimination
    with partial pivoting; a ridge-regularised Gram matrix is positive definite)."""
    n = len(free)
    system = [[gram[i][j] for j in free] + [moment[i]] for i in free]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(system[r][column]))
        system[column], system[pivot] = system[pivot], system[column]
        for r in range(n):
            if r != column and system[r][column]:
                factor = system[r][column] / system[column][column]
                for k in range(column, n + 1):
                    system[r][k] -= factor * system[column][k]
    theta = [0.0] * size
    for k, i in enumerate(free):
        theta[i] = system[k][n] / system[k][k]
    return theta


def exact_reach(shape: StepShape) -> int:
    """The longest KV a chunk of the step reaches, unpadded."""
    return max((c.history + c.rows for c in shape.chunks), default=0)


def extent(shape: StepShape, kv_bucket: int = 0) -> tuple[int, int]:
    """(prefill rows, longest KV a chunk reaches), padded as the engine pads: what the trust region compares."""
    if _padded(shape, kv_bucket):
        rows = sum(query_bucket(c.rows) for c in shape.chunks)
        return rows, max(history_bucket(c.history + c.rows, kv_bucket) for c in shape.chunks)
    return shape.prefill_rows, exact_reach(shape)


class TrustRegion:
    """How far a fit is believed, both ways: see the module docstring. Fixed memory (`TRUST_MEMORY` steps); the
    references by reach are rebuilt at the first prediction after a trained step (~0.1 ms for 200 steps), so each
    ceiling look-up is a binary search; floors are worked out once per shape between two trained steps."""

    def __init__(self, factor: float, memory: int = TRUST_MEMORY) -> None:
        self.factor = factor  # 0: off
        self.steps: deque[Remembered] = deque(maxlen=memory)
        # by reach, ascending: (reach, rows of the largest step reaching at least that far, its least ms per row)
        self.references: list[tuple[int, int, float]] = []
        self._reaches: list[int] = []
        self._stale = False
        self._floors: dict[tuple[int, int, int, bool, int], list[float]] = {}

    def record(
        self, rows: int, reach: int, elapsed_ms: float, lanes: int = 0, compiled: bool = False, width: int = 1,
        exact_reach: int | None = None,
    ) -> None:
        if self.factor:
            exact = reach if exact_reach is None else exact_reach
            self.steps.append(Remembered(reach, rows, lanes, compiled, width, elapsed_ms, exact))
            self._stale = True
            self._floors.clear()

    def least_ms(self, rows: int, reach: int) -> float | None:
        """The least a step of `rows` reaching `reach` may be priced; None inside the region (or nothing known)."""
        if self._stale:
            self._rebuild()
        if not self.references:
            return None
        # none as long: the largest of the steps that reached farthest (a prompt read for the first time grows its
        # chunks by the factor a step, not by the fit's word)
        index = min(bisect.bisect_left(self._reaches, reach), len(self._reaches) - 1)
        _, largest, ms_per_row = self.references[index]
        return None if rows <= max(self.factor * largest, largest + LEAST_GROWTH_ROWS) else rows * ms_per_row

    def floor_ms(self, rows: int, exact_reach: int, lanes: int, compiled: bool, width: int) -> float | None:
        """The least a step may be priced from below: what the cheapest of the largest remembered steps that did no
        more work (no more rows, exact KV reach, decode lanes or chunks) took. The cheapest, so a stall among them
        sets nothing. A compiled step is compared with compiled ones only (an eager one with either: a trace is
        never dearer than the graph it replays)."""
        times = self._largest_within(rows, exact_reach, lanes, compiled, width)
        return times[0] if times else None

    def typical_ms(self, rows: int, exact_reach: int, lanes: int, compiled: bool, width: int) -> float | None:
        """The median time of the same steps `floor_ms` takes the cheapest of: what such steps typically took (the
        first ones a fresh fit trains on are bounded far under their time, and a cheapest would be one of those)."""
        times = self._largest_within(rows, exact_reach, lanes, compiled, width)
        return statistics.median(times) if times else None

    def _largest_within(self, rows: int, exact_reach: int, lanes: int, compiled: bool, width: int) -> list[float]:
        """The times of the largest remembered steps that did no more work than this step (see `floor_ms`), sorted
        once per shape between two trained steps: every prediction asks for the cheapest."""
        key = (rows, exact_reach, lanes, compiled, width)
        if key not in self._floors:
            largest, times = 0, []
            for step in self.steps:
                if (largest <= step.rows <= rows and step.exact_reach <= exact_reach and step.lanes <= lanes
                        and step.width <= width and (step.compiled or not compiled)):  # fmt: skip
                    if step.rows > largest:
                        largest, times = step.rows, [step.ms]
                    else:
                        times.append(step.ms)
            self._floors[key] = sorted(times)
        return self._floors[key]

    def _rebuild(self) -> None:
        references: list[tuple[int, int, float]] = []
        largest, least = 0, math.inf
        # longest reach first (the most rows first within one): a running maximum
        for step in sorted(self.steps, key=lambda step: (step.reach, step.rows), reverse=True):
            reach, rows, ms_per_row = step.reach, step.rows, step.ms_per_row
            if rows > largest:
                largest, least = rows, ms_per_row
            elif rows == largest:
                least = min(least, ms_per_row)
            if references and references[-1][0] == reach:
                references[-1] = (reach, largest, least)
            else:
                references.append((reach, largest, least))
        self.references = references[::-1]
        self._reaches = [reference[0] for reference in self.references]
        self._stale = False


class Remembered(NamedTuple):
    """A trained step as the trust region keeps it (its extent padded as the engine pads; `ms` as trained)."""

    reach: int
    rows: int
    lanes: int
    compiled: bool
    width: int
    ms: float
    exact_reach: int  # the longest KV a chunk reached, unpadded (what a kernel reading the pool pays for)

    @property
    def ms_per_row(self) -> float:
        return self.ms / self.rows


def residual_cell(shape: StepShape) -> tuple[Path, int, int, bool, bool]:
    """The steps whose misses one correction remembers: path, query bucket of the rows, chunks, whether decode
    lanes rode along, form."""
    return shape.path, query_bucket(shape.prefill_rows), shape.width, shape.decode_lanes > 0, shape.compiled


class ResidualCorrection:
    """Per `residual_cell`, an exponential average (`weight` a sample) of measured minus predicted ms, each sample
    and the correction held within `RESIDUAL_BOUND` of the prediction. Cells are few: query buckets x widths."""

    def __init__(self, weight: float) -> None:
        self.weight = weight  # 0: off
        self.offsets: dict[tuple[Path, int, int, bool, bool], float] = {}

    def corrected(self, shape: StepShape, predicted: float) -> float:
        offset = self.offsets.get(residual_cell(shape), 0.0)
        bound = RESIDUAL_BOUND * predicted
        return predicted + min(max(offset, -bound), bound)

    def observe(self, shape: StepShape, predicted: float, elapsed_ms: float) -> None:
        if not self.weight:
            return
        bound = RESIDUAL_BOUND * predicted
        miss = min(max(elapsed_ms - predicted, -bound), bound)
        cell = residual_cell(shape)
        previous = self.offsets.get(cell, 0.0)
        self.offsets[cell] = previous + self.weight * (miss - previous)


class AffineCostModel:
    name = "affine"

    def __init__(
        self, kv_bucket: int = 0, trust_factor: float = TRUST_FACTOR, pads_history: bool = True,
        residual_weight: float = 0.0,
    ) -> None:  # fmt: skip
        self.kv_bucket = kv_bucket  # the engine's KV bucket unit (`SchedulerConfig.kv_bucket`); 0: exact shapes
        self.pads_history = pads_history  # `SchedulerConfig.pads_history`
        self.baseline = EmaCostModel()
        self.fits = {path: SignedLeastSquares(SIGNS) for path in (Path.GPU, Path.ANE)}
        self.trust = {path: TrustRegion(trust_factor) for path in (Path.GPU, Path.ANE)}
        self.residuals = ResidualCorrection(residual_weight)

    def predict(self, shape: StepShape) -> float | None:
        fitted = self._fitted(shape)
        if fitted is not None:
            return self.residuals.corrected(shape, fitted)
        return self.baseline.predict(shape)

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        """What the largest remembered steps that did no more work than `shape` typically took (their median, as
        trained: measured, not fitted); None where none is remembered."""
        rows, _ = extent(shape, self.kv_bucket)
        return self.trust[shape.path].typical_ms(rows, exact_reach(shape), shape.decode_lanes, shape.compiled,
                                                 shape.width)  # fmt: skip

    def _fitted(self, shape: StepShape) -> float | None:
        """The fit's price within its trust region; None until the fit answers (or if it answers nonsense)."""
        fit = self.fits[shape.path]
        if fit.samples >= MIN_SAMPLES:
            predicted = fit.predict(features(shape, self.kv_bucket, self.pads_history))
            if math.isfinite(predicted) and predicted > 0:
                trust, (rows, reach) = self.trust[shape.path], extent(shape, self.kv_bucket)
                least = trust.least_ms(rows, reach)
                floor = trust.floor_ms(rows, exact_reach(shape), shape.decode_lanes, shape.compiled, shape.width)
                return max(predicted, least or 0.0, floor or 0.0)
        return None

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        if not is_trainable(shape, elapsed_ms):
            return
        fit, x = self.fits[shape.path], features(shape, self.kv_bucket, self.pads_history)
        baseline = self.baseline.predict(shape) if shape.path is Path.GPU else None  # the ema learns the GPU only
        bounded = _bounded(fit, x, elapsed_ms, baseline)
        fitted = self._fitted(shape) if self.residuals.weight else None
        if fitted is not None:
            self.residuals.observe(shape, fitted, bounded)
        self.baseline.observe(shape, bounded)
        fit.observe(x, bounded)
        self.trust[shape.path].record(*extent(shape, self.kv_bucket), bounded, shape.decode_lanes, shape.compiled,
                                      shape.width, exact_reach(shape))  # fmt: skip


def _bounded(fit: SignedLeastSquares, x: tuple[float, ...], elapsed_ms: float, baseline: float | None) -> float:
    """`elapsed_ms` within `OUTLIER_FACTOR` of the fit's prediction (once it answers) or of the `ema` baseline's,
    whichever allows more; as measured before either predicts. The baseline bounds the first steps (H200 4-bit runs
    met first-use kernel builds of 1.3-2.5 s among them, which an unbounded fit of 8 samples learned as the cost of
    rows) and keeps a fit that predicts far too little from capping every true sample at 3x its own error (the
    same run's fit then predicted 0.4-1.4 ms for 384-row steps of 25 ms for tens of steps)."""
    references = [baseline, fit.predict(x) if fit.samples >= MIN_SAMPLES else None]
    references = [p for p in references if p is not None and math.isfinite(p) and p > 0]
    if not references:
        return elapsed_ms
    return min(max(elapsed_ms, min(references) / OUTLIER_FACTOR), max(references) * OUTLIER_FACTOR)
