"""Training the cost model from a step's outcome: contended prefill steps only, each path on its own time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from scheduler.cost_models import CostModel, PrefillChunk, StepShape
from scheduler.plan import Lane, LaneKind, Path, StepOutcome, StepPlan
from scheduler.traced_shapes import TracedShapes


def step_shapes(lanes: Sequence[Lane], auxiliary: bool = False, compiled: bool = False) -> dict[Path, StepShape]:
    """The prefill chunks grouped by the path each was committed to (decode lanes run on the GPU; `compiled`:
    the GPU lanes' form)."""
    chunks: dict[Path, list[PrefillChunk]] = {}
    decode_lanes = 0
    for lane in lanes:
        if lane.kind is LaneKind.DECODE:
            decode_lanes += 1
        else:
            chunks.setdefault(lane.path, []).append(PrefillChunk(lane.rows, lane.history))
    return {
        path: StepShape(
            tuple(path_chunks), decode_lanes if path is Path.GPU else 0, path, auxiliary, compiled and path is Path.GPU
        )
        for path, path_chunks in chunks.items()
    }


def predict_planned_gpu_ms(
    model: CostModel, lanes: Sequence[Lane], traced: TracedShapes | None, stand_in_limit_ms: float | None = None
) -> float | None:
    """The model's prediction for the GPU part of the lanes as finally planned (after cuts and ANE moves), in the
    form the engine will run it; with `stand_in_limit_ms` (the step's limit), a step that would replay a larger
    trace in place of its own is that trace's last run (`price_stand_in_runs`)."""
    shape = step_shapes(lanes).get(Path.GPU)
    if shape is None:
        return None
    decode = [lane for lane in lanes if lane.kind is LaneKind.DECODE]
    compiled = traced is not None and traced.traced(shape.chunks, decode)
    if traced is not None and stand_in_limit_ms is not None:
        replayed_ms = traced.stand_in_run_ms(shape.chunks, decode, stand_in_limit_ms)
        if replayed_ms is not None:
            return replayed_ms
    return model.predict(replace(shape, compiled=compiled))


def train_cost_model(model: CostModel, plan: StepPlan, outcome: StepOutcome) -> None:
    """Feed the measured times of a contended step to the model (it filters what it cannot learn from)."""
    if not plan.contended or outcome.failed:
        return
    for path, shape in step_shapes(plan.lanes, outcome.auxiliary, outcome.compiled).items():
        elapsed_ms = outcome.elapsed_ms if path is Path.GPU else outcome.ane_elapsed_ms
        if elapsed_ms is not None:
            model.observe(shape, elapsed_ms)
