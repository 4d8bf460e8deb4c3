"""Prefill cost models: predict a contended step's time from its shape, learn from measured steps.

Selected by `SchedulerConfig.cost_model` (env `MLX_SERVE_PREFILL_COST_MODEL` overrides):

- `ema` (baseline, default): one global milliseconds-per-row estimate, an EMA (weight 0.25) over observed
  contended prefill steps. Capacity-based: a sample is the step's measured time over the prefill rows it
  actually ran, so an underfilled trial budget (fewer rows waiting than the budget allowed) teaches it too.
  Untrained, it predicts None and the scheduler keeps the ceiling (the first contended step is the trial).
- `bucketed` (seed): a fixed table of 96 cells = 3 row bands x 4 history bands x 4 width bands x 2 paths,
  each an EWMA (weight 0.25) of ms per row. Band edges (lower bounds, inclusive):
    rows (prefill rows in the step):          0 | 256 | 1024            -> [0,256) [256,1024) [1024,inf)
    history (row-weighted over the lanes):    0 | 1024 | 4096 | 16384   -> [0,1k) [1k,4k) [4k,16k) [16k,inf)
    width (prefill lanes in the step):        1 | 2 | 3 | 5             -> 1, 2, 3-4, 5+
    path:                                     gpu | ane
  Row-weighted history = sum(rows_i * history_i) / sum(rows_i), so a short leading lane cannot hide a
  long-history lane behind it. A cell is used once it has 3 samples; before that the prediction is exactly
  the `ema` baseline's, which the table trains alongside itself on the same observations.
- `affine` (optional): fixed + per-row + per-attention-pair + per-decode-lane + per-extra-prefill-lane
  milliseconds, less a learned saving for a step that replays a compiled trace (padded counts where the engine pads
  chunks), fit online by recursive least squares with forgetting, one fit per path; falls back to `ema` until it
  has 8 samples.

Every model trains only on trainable observations: finite, positive time, >= 64 prefill rows, text prefill
(auxiliary work such as KV restore/prefix copies or images never trains). The path of a shape is the path its
chunks were committed to when planned, so a lane moved while in flight never trains the other path.
Memory is fixed: no growth, no persistence, no sharing across engines.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Protocol

from scheduler.plan import Path

EWMA_WEIGHT = 0.25
MIN_TRAINING_ROWS = 64
CELL_MIN_SAMPLES = 3
ROW_BAND_EDGES = (256, 1024)
HISTORY_BAND_EDGES = (1024, 4096, 16384)
WIDTH_BAND_EDGES = (2, 3, 5)
PATHS = (Path.GPU, Path.ANE)
NUM_CELLS = (
    (len(ROW_BAND_EDGES) + 1) * (len(HISTORY_BAND_EDGES) + 1) * (len(WIDTH_BAND_EDGES) + 1) * len(PATHS)
)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    rows: int
    history: int  # tokens already in the request's KV before this chunk


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a cost model sees of a step: the prefill chunks of one path, and the decode lanes beside them."""

    chunks: tuple[PrefillChunk, ...]
    decode_lanes: int = 0
    path: Path = Path.GPU
    auxiliary: bool = False  # restore/prefix-copy/image work or a shape's first trace or run rode along: never trains
    # the GPU lanes run (or ran) through a compiled trace: on a host-bound GPU the same rows cost a fraction of an
    # eager step, so the affine model prices the two apart (`traced_shapes.TracedShapes` says which a plan gets)
    compiled: bool = False

    @property
    def prefill_rows(self) -> int:
        return sum(chunk.rows for chunk in self.chunks)

    @property
    def width(self) -> int:
        return len(self.chunks)

    @property
    def weighted_history(self) -> float:
        rows = self.prefill_rows
        return sum(c.rows * c.history for c in self.chunks) / rows if rows else 0.0

    @property
    def attention_pairs(self) -> float:
        return sum(c.rows * (c.history + c.rows / 2) for c in self.chunks)


def is_trainable(shape: StepShape, elapsed_ms: float) -> bool:
    return (
        not shape.auxiliary
        and shape.prefill_rows >= MIN_TRAINING_ROWS
        and math.isfinite(elapsed_ms)
        and elapsed_ms > 0
    )


class CostModel(Protocol):
    name: str

    def predict(self, shape: StepShape) -> float | None: ...

    def observe(self, shape: StepShape, elapsed_ms: float) -> None: ...

    # what the largest remembered steps that did no more work than the shape typically took; None: none kept
    def measured_floor_ms(self, shape: StepShape) -> float | None: ...


class EmaCostModel:
    """One global ms-per-row EMA over GPU contended prefill steps."""

    name = "ema"

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        self.weight = weight
        self.ms_per_row: float | None = None
        self.samples = 0

    def predict(self, shape: StepShape) -> float | None:
        return None if self.ms_per_row is None else self.ms_per_row * shape.prefill_rows

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        if shape.path is not Path.GPU or not is_trainable(shape, elapsed_ms):
            return
        sample = elapsed_ms / shape.prefill_rows
        previous = self.ms_per_row
        self.ms_per_row = sample if previous is None else previous + self.weight * (sample - previous)
        self.samples += 1

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        return None  # one rate: no step is remembered


def _band(value: float, edges: tuple[int, ...]) -> int:
    return sum(1 for edge in edges if value >= edge)


def cell_index(shape: StepShape) -> int:
    """The table cell of a shape: row band, history band, width band, path, in row-major order."""
    row_band = _band(shape.prefill_rows, ROW_BAND_EDGES)
    history_band = _band(shape.weighted_history, HISTORY_BAND_EDGES)
    width_band = _band(shape.width, WIDTH_BAND_EDGES)
    path_index = PATHS.index(shape.path)
    index = row_band
    index = index * (len(HISTORY_BAND_EDGES) + 1) + history_band
    index = index * (len(WIDTH_BAND_EDGES) + 1) + width_band
    return index * len(PATHS) + path_index


class BucketedCostModel:
    """The seed's 96-cell table of ms-per-row EWMAs, falling back exactly to `ema` per untrained cell."""

    name = "bucketed"

    def __init__(self) -> None:
        self.baseline = EmaCostModel()
        self.ms_per_row = array("d", bytes(8 * NUM_CELLS))
        self.samples = array("I", bytes(4 * NUM_CELLS))

    def predict(self, shape: StepShape) -> float | None:
        cell = cell_index(shape)
        if self.samples[cell] < CELL_MIN_SAMPLES:
            return self.baseline.predict(shape)
        return self.ms_per_row[cell] * shape.prefill_rows

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        if not is_trainable(shape, elapsed_ms):
            return
        self.baseline.observe(shape, elapsed_ms)
        cell = cell_index(shape)
        sample = elapsed_ms / shape.prefill_rows
        if self.samples[cell] == 0:
            self.ms_per_row[cell] = sample
        else:
            self.ms_per_row[cell] += EWMA_WEIGHT * (sample - self.ms_per_row[cell])
        self.samples[cell] = min(self.samples[cell] + 1, 2**32 - 1)

    def measured_floor_ms(self, shape: StepShape) -> float | None:
        return None  # rates per cell: no step is remembered

    def memory_bytes(self) -> int:
        return self.ms_per_row.itemsize * len(self.ms_per_row) + self.samples.itemsize * len(self.samples)


def make_cost_model(
    name: str, kv_bucket: int = 0, trust_factor: float = 1.5, pads_history: bool = True, residual_weight: float = 0.0
) -> CostModel:
    """The cost model called `name` ("ema", "bucketed" or "affine"); `kv_bucket` and `pads_history`: how the engine
    pads chunks (`SchedulerConfig`), which the affine model counts; `trust_factor` and `residual_weight`: the affine
    model's trust region and per-cell correction (`SchedulerConfig.cost_trust_factor`, `cost_residual_weight`)."""
    if name == "ema":
        return EmaCostModel()
    if name == "bucketed":
        return BucketedCostModel()
    if name == "affine":
        from scheduler.affine_cost import AffineCostModel

        return AffineCostModel(kv_bucket, trust_factor, pads_history, residual_weight)
    raise ValueError(f"unknown prefill cost model {name!r}: expected ema, bucketed or affine")
