"""`python -m benchmarks.gpu.replay_cost_model RESULT.json[.gz]...`: the contended steps of recorded GPU bench runs,
replayed through the affine cost model counted exactly and counted as the engine pads (`SchedulerConfig.kv_bucket`,
and the run's `pads_history`: whether its chunk attention computed over the padded history).

Each run's steps with prefill (warm pass, then the measured pass, as `run_gpu_bench` records them) go through
`tracing.prefill_prediction.replay`: predicted from the earlier ones only, then observed, as the scheduler does live;
the steps without decode lanes (the solo prefill before the streams) train the model, as live, and are not scored.
Prints, per shape, the mean absolute and the mean signed relative error (positive: the model over-predicts, so
budgets come out smaller than the target allows).

A replay cannot change which budgets were chosen, so it scores prediction on the shapes that ran, not the planning.
Runs recorded before the prefill lanes were (a sixth field) count every step as one lane.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from scheduler.affine_cost import AffineCostModel
from scheduler.buckets import KV_BUCKET, query_bucket
from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.plan import Path as LanePath
from tracing.prefill_prediction import Observation, replay

# the affine fit's features, in order (`affine_cost.features`): ms, ms a thousand rows, ms a million pairs, ms a
# decode lane, ms an extra prefill lane, ms for replaying a trace
COEFFICIENTS = ("fixed", "rows_k", "pairs_m", "decode_lane", "extra_lane", "compiled")

# prefill rows, decode lanes, row-weighted history, measured ms, prefill lanes, auxiliary (never trained live),
# compiled (replayed a trace)
Step = tuple[int, int, float, float, int, bool, bool]


class RecordedRun(NamedTuple):
    shape: str
    observations: list[Observation]  # in order; the scored ones are `contended`
    # whether the run's chunk attention computed over the padded history (recorded since the twenty-third run;
    # before it, runs of the paged kernel, from the twenty-second, were recorded without saying so)
    pads_history: bool
    live: bool  # from the engine's own `cost_observations` (since the twenty-fourth run), not `prefill_steps`


def read_result(path: Path) -> dict:
    """A bench result file, plain or gzipped (`benchmarks/gpu/logs` keeps them gzipped: the device's copy of the
    working tree is capped at 64 MiB, beside the staged MLX wheel)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def recorded_runs(paths: list[Path]) -> list[RecordedRun]:
    """Every run in the bench result files that recorded its steps."""
    found = (recorded_run(result) for path in paths for result in read_result(path).get("results", []))
    return [run for run in found if run is not None]


def recorded_run(result: dict) -> RecordedRun | None:
    """One shape's recorded steps (None: it recorded none)."""
    ours = result.get("ours", {})
    pads_history = bool(ours.get("pads_history", True))
    if ours.get("cost_observations"):
        scored_from = ours.get("contended", {}).get("cost_observations_from", 0)
        return RecordedRun(result["shape"], live_observations(ours["cost_observations"], scored_from), pads_history,
                           True)  # fmt: skip
    steps = []
    for phase in ("contended_warm", "contended"):
        for step in ours.get(phase, {}).get("steps", {}).get("prefill_steps", []):
            lanes = step[5] if len(step) > 5 else 1  # recorded since the eighteenth run
            auxiliary = bool(step[6]) if len(step) > 6 else False  # since the nineteenth
            compiled = bool(step[7]) if len(step) > 7 else False  # since the twentieth
            steps.append((step[0], step[1], step[2], step[3], lanes, auxiliary, compiled))
    return RecordedRun(result["shape"], observations(steps), pads_history, False) if steps else None


def live_observations(recorded: list[list], scored_from: int) -> list[Observation]:
    """The steps the live cost model was shown, as shown (`ours.py`: `cost_observations`); scored: the measured
    pass's (from `scored_from`), with decode lanes."""
    found = []
    for index, (chunks, decode_lanes, path, auxiliary, compiled, measured_ms) in enumerate(recorded):
        shape = StepShape(tuple(PrefillChunk(rows, history) for rows, history in chunks), decode_lanes,
                          LanePath(path), auxiliary, compiled)  # fmt: skip
        found.append(Observation(shape, measured_ms, contended=index >= scored_from and bool(decode_lanes)))
    return found


def observations(steps: list[Step]) -> list[Observation]:
    """Every step, its rows split evenly over its prefill lanes at their row-weighted history; contended (scored)
    where it had decode lanes. The live model trains on both: a stall in the solo prefill misled it too."""
    found = []
    for rows, decode_lanes, history, measured_ms, lanes, auxiliary, compiled in steps:
        lanes = max(1, min(lanes, rows))
        chunks = tuple(PrefillChunk(rows // lanes + (i < rows % lanes), round(history)) for i in range(lanes))
        shape = StepShape(chunks, decode_lanes, auxiliary=auxiliary, compiled=compiled)
        found.append(Observation(shape, measured_ms, contended=bool(decode_lanes)))
    return found


def signed_errors(
    found: list[Observation], kv_bucket: int, pads_history: bool = True, residual_weight: float = 0.0
) -> list[float]:
    """The affine model's prequential signed relative errors over one run's scored steps."""
    return scored_errors(found, kv_bucket, pads_history, residual_weight)[1]


def scored_errors(
    found: list[Observation], kv_bucket: int, pads_history: bool = True, residual_weight: float = 0.0
) -> tuple[list[StepShape], list[float]]:
    """The scored steps' shapes and the affine model's prequential signed relative errors on them, in order."""
    result = replay(found, ("affine",), kv_bucket, pads_history, residual_weight)
    return result["contended_shapes"]["affine"], result["signed_contended"]["affine"]


def mean_errors(errors: list[float]) -> str:
    """'mean abs / mean signed' relative error."""
    return f"{sum(map(abs, errors)) / len(errors):.1%} / {sum(errors) / len(errors):+.1%}" if errors else "-"


def print_by_rows(padded: dict[str, list[tuple[StepShape, float]]]) -> None:
    """Per shape and query bucket of the rows (one-chunk steps), the padded count's errors (`padded`: each shape's
    scored steps and their errors): where the fit's one rows slope misprices a size the GPU runs at another rate."""
    print("| shape | rows (query bucket) | steps | mean abs / signed error |")
    print("|---|---|---|---|")
    for shape, scored in sorted(padded.items()):
        by_rows: dict[int, list[float]] = defaultdict(list)
        for step, error in scored:
            if step.width == 1:
                by_rows[query_bucket(step.prefill_rows)].append(error)
        for rows, errors in sorted(by_rows.items()):
            print(f"| {shape} | {rows} | {len(errors)} | {mean_errors(errors)} |")


def final_coefficients(run: RecordedRun) -> dict[str, float]:
    """The GPU fit's coefficients once the run's steps are replayed through it, counted as its engine padded them:
    where a pass never excites a direction (every step 8 lanes, one chunk), these say how far the fit drifted."""
    model = AffineCostModel(KV_BUCKET, pads_history=run.pads_history)
    for found in run.observations:
        model.observe(found.shape, found.measured_ms)
    return dict(zip(COEFFICIENTS, (round(t, 3) for t in model.fits[LanePath.GPU].theta), strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files (or .json.gz)")
    parser.add_argument("--coefficients", action="store_true", help="also print each run's fit at its end")
    parser.add_argument("--residual-weight", type=float, default=0.0, metavar="W",
                        help="replay with SchedulerConfig.cost_residual_weight W (default: 0, the plain fit; "
                             "the engine's default is 0.3)")
    parser.add_argument("--by-rows", action="store_true",
                        help="also print the padded count's errors by the rows' query bucket")
    args = parser.parse_args(argv)
    runs = recorded_runs(args.results)
    if not runs:
        print("no recorded contended steps in these files", file=sys.stderr)
        return 1
    for run in runs if args.coefficients else ():
        print(json.dumps({"shape": run.shape, "coefficients": final_coefficients(run)}))
    print("| shape | runs | steps scored | exact: mean abs / signed error | padded: mean abs / signed error |")
    print("|---|---|---|---|---|")
    by_shape: dict[str, list[RecordedRun]] = defaultdict(list)
    for run in runs:
        by_shape[run.shape].append(run)
    padded: dict[str, list[tuple[StepShape, float]]] = defaultdict(list)
    for shape, shape_runs in sorted(by_shape.items()):
        exact = [e for run in shape_runs
                 for e in signed_errors(run.observations, 0, run.pads_history, args.residual_weight)]
        for run in shape_runs:
            padded[shape] += zip(*scored_errors(run.observations, KV_BUCKET, run.pads_history, args.residual_weight))
        errors = [error for _, error in padded[shape]]
        print(f"| {shape} | {len(shape_runs)} | {len(errors)} | {mean_errors(exact)} | {mean_errors(errors)} |")
    if args.by_rows:
        print()
        print_by_rows(padded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
