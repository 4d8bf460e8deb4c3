"""`python -m benchmarks.gpu.replay_cost_model RESULT.json...`: the contended steps of recorded GPU bench runs, replayed
through the affine cost model counted exactly and counted as the engine pads (`SchedulerConfig.kv_bucket`).

Each run's steps with prefill (warm pass, then the measured pass, as `run_gpu_bench` records them) are predicted from
the earlier ones only, then observed, as the scheduler does live; only contended steps (with decode lanes) train and
are scored, after the first `--skip` of them. Prints, per shape, the mean absolute and the mean signed relative error
(positive: the model overestimates, so budgets come out smaller than the target allows).

A replay cannot change which budgets were chosen, so it scores prediction on the shapes that ran, not the planning.
Runs recorded before the prefill lanes were (a sixth field) count every step as one lane.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from scheduler.buckets import KV_BUCKET
from scheduler.cost_models import PrefillChunk, StepShape, make_cost_model

Step = tuple[int, int, float, float, int]  # prefill rows, decode lanes, row-weighted history, measured ms, lanes


def recorded_runs(paths: list[Path]) -> list[tuple[str, list[Step]]]:
    """(shape, steps with prefill in order) of every run in the bench result files that recorded its steps."""
    runs = []
    for path in paths:
        for result in json.loads(path.read_text()).get("results", []):
            ours = result.get("ours", {})
            steps = []
            for phase in ("contended_warm", "contended"):
                for step in ours.get(phase, {}).get("steps", {}).get("prefill_steps", []):
                    lanes = step[5] if len(step) > 5 else 1
                    steps.append((step[0], step[1], step[2], step[3], lanes))
            if steps:
                runs.append((result["shape"], steps))
    return runs


def shape_of(step: Step) -> StepShape:
    """The step's shape, its rows split evenly over its prefill lanes at their row-weighted history."""
    rows, decode_lanes, history, _, lanes = step
    lanes = max(1, min(lanes, rows))
    chunks = tuple(PrefillChunk(rows // lanes + (i < rows % lanes), round(history)) for i in range(lanes))
    return StepShape(chunks, decode_lanes)


def replay(steps: list[Step], kv_bucket: int, skip: int) -> list[float]:
    """Signed relative errors of the prequential predictions of the contended steps after the first `skip`."""
    model = make_cost_model("affine", kv_bucket)
    errors, seen = [], 0
    for step in steps:
        if not step[1]:  # no decode lanes: not contended, the scheduler neither trains on it nor plans with it
            continue
        shape, measured = shape_of(step), step[3]
        predicted = model.predict(shape)
        if predicted is not None and seen >= skip and measured > 0:
            errors.append((predicted - measured) / measured)
        model.observe(shape, measured)
        seen += 1
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files")
    parser.add_argument("--skip", type=int, default=10, help="contended steps each run trains on before scoring")
    args = parser.parse_args(argv)
    runs = recorded_runs(args.results)
    if not runs:
        print("no recorded contended steps in these files", file=sys.stderr)
        return 1
    print("| shape | runs | steps | exact: mean abs / signed error | padded: mean abs / signed error |")
    print("|---|---|---|---|---|")
    by_shape: dict[str, list[list[Step]]] = defaultdict(list)
    for shape, steps in runs:
        by_shape[shape].append(steps)
    for shape, shape_runs in sorted(by_shape.items()):
        cells = []
        for kv_bucket in (0, KV_BUCKET):
            errors = [e for steps in shape_runs for e in replay(steps, kv_bucket, args.skip)]
            cells.append(f"{sum(map(abs, errors)) / len(errors):.1%} / {sum(errors) / len(errors):+.1%}" if errors else "-")
        count = sum(len(replay(steps, 0, args.skip)) for steps in shape_runs)
        print(f"| {shape} | {len(shape_runs)} | {count} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
