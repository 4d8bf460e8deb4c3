"""The optional `affine` prefill cost model: fixed + per-row + per-attention-pair + per-decode-lane milliseconds.

attention pairs = sum over the prefill lanes of rows x (history + rows / 2). One fit per path, by recursive least
squares with forgetting (0.995: roughly the last 200 steps matter), so it tracks drift without storing samples.
Until a path's fit has 8 samples, or if its prediction is not a positive finite number, it answers exactly as
the `ema` baseline it trains alongside. Same training filter as the other models; fixed memory.

A least-squares fit has no defence against one wild sample, such as a step that stalled on a first-use compile
(H200, 8B 4-bit: a skewed fit predicted 120-row steps of 15 ms at 40-130 ms for a hundred steps, while a fresh fit
of the same steps predicted them within a few ms). So a fitted path trains on the measured time bounded to within
`OUTLIER_FACTOR` of its own prediction: one such sample moves the fit a bounded way, and a lasting change of cost
is still learned.
"""

from __future__ import annotations

import math

from scheduler.cost_models import EmaCostModel, StepShape, is_trainable
from scheduler.plan import Path

FORGETTING = 0.995
MIN_SAMPLES = 8
INITIAL_COVARIANCE = 1e6
PAIR_SCALE = 1e-3  # pairs are counted in thousands so the four features have comparable magnitudes
OUTLIER_FACTOR = 3.0  # a fitted path trains on at most 3x (at least a third of) its prediction


def features(shape: StepShape) -> tuple[float, float, float, float]:
    return (1.0, float(shape.prefill_rows), shape.attention_pairs * PAIR_SCALE, float(shape.decode_lanes))


class RecursiveLeastSquares:
    """theta minimising the exponentially forgotten squared error of y ~ theta . x."""

    def __init__(self, size: int, forgetting: float = FORGETTING) -> None:
        self.forgetting = forgetting
        self.theta = [0.0] * size
        self.covariance = [[INITIAL_COVARIANCE if i == j else 0.0 for j in range(size)] for i in range(size)]
        self.samples = 0

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def observe(self, x: tuple[float, ...], y: float) -> None:
        size = len(self.theta)
        px = [sum(self.covariance[i][j] * x[j] for j in range(size)) for i in range(size)]
        denominator = self.forgetting + sum(x[i] * px[i] for i in range(size))
        gain = [value / denominator for value in px]
        error = y - self.predict(x)
        self.theta = [t + g * error for t, g in zip(self.theta, gain, strict=True)]
        self.covariance = [
            [(self.covariance[i][j] - gain[i] * px[j]) / self.forgetting for j in range(size)] for i in range(size)
        ]
        self.samples += 1


class AffineCostModel:
    name = "affine"

    def __init__(self) -> None:
        self.baseline = EmaCostModel()
        self.fits = {path: RecursiveLeastSquares(4) for path in (Path.GPU, Path.ANE)}

    def predict(self, shape: StepShape) -> float | None:
        fit = self.fits[shape.path]
        if fit.samples >= MIN_SAMPLES:
            predicted = fit.predict(features(shape))
            if math.isfinite(predicted) and predicted > 0:
                return predicted
        return self.baseline.predict(shape)

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        if not is_trainable(shape, elapsed_ms):
            return
        self.baseline.observe(shape, elapsed_ms)
        fit, x = self.fits[shape.path], features(shape)
        fit.observe(x, _bounded(fit, x, elapsed_ms))


def _bounded(fit: RecursiveLeastSquares, x: tuple[float, ...], elapsed_ms: float) -> float:
    """`elapsed_ms` within `OUTLIER_FACTOR` of the fit's prediction once the fit answers; as measured before."""
    predicted = fit.predict(x)
    if fit.samples < MIN_SAMPLES or not math.isfinite(predicted) or predicted <= 0:
        return elapsed_ms
    return min(max(elapsed_ms, predicted / OUTLIER_FACTOR), predicted * OUTLIER_FACTOR)
