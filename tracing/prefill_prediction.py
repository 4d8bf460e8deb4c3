"""`python -m tracing.prefill_prediction TRACE...`: prequential replay of prefill observations through each cost model.

Every trainable prefill step of the captures, in order, is first predicted by each model from earlier observations
only, then observed. Prints mean and p95 absolute relative error per model, overall, per path and per width.
The models are the scheduler's own (`scheduler.cost_models.make_cost_model`), so this measures what runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from scheduler.cost_models import PrefillChunk, StepShape, is_trainable, make_cost_model
from scheduler.plan import Path as LanePath
from tracing import events as ev
from tracing.analysis import percentile
from tracing.jsonl import CaptureError, load

DEFAULT_MODELS = ("ema", "bucketed", "affine")


@dataclass(frozen=True, slots=True)
class Observation:
    shape: StepShape
    measured_ms: float
    contended: bool


def observations(events: list[object]) -> tuple[list[Observation], int]:
    """Prefill observations in execution order, and how many mixed-path steps had to be skipped.

    A step's shape comes from its plan (lanes after any cut, each with its committed path) joined with the runner's
    measured time. A mixed GPU+ANE step has one time for two paths, so it cannot train either honestly.
    """
    planned = {e.step_id: e for e in events if isinstance(e, ev.StepPlanned)}
    found, skipped = [], 0
    for step in (e for e in events if isinstance(e, ev.StepExecuted)):
        plan = planned.get(step.step_id)
        if plan is None or step.prefill_rows == 0:
            continue
        prefill = [lane for lane in plan.lanes if lane.kind == "prefill"]
        paths = {lane.path for lane in prefill}
        if len(paths) != 1:
            skipped += 1
            continue
        shape = StepShape(
            chunks=tuple(PrefillChunk(lane.rows, lane.history) for lane in prefill),
            decode_lanes=step.decode_lanes,
            path=LanePath(paths.pop()),
            auxiliary=step.auxiliary,
            compiled=step.compiled,
        )
        found.append(Observation(shape, step.measured_ms, plan.contended))
    return found, skipped


def available_models(
    names: tuple[str, ...], kv_bucket: int = 0, pads_history: bool = True, residual_weight: float = 0.0
) -> list:
    models = []
    for name in names:
        try:
            models.append(make_cost_model(name, kv_bucket, pads_history=pads_history, residual_weight=residual_weight))
        except (ValueError, ImportError) as exc:  # a newer model that this checkout does not have yet
            print(f"note: skipping cost model {name!r}: {exc}", file=sys.stderr)
    return models


def replay(
    found: list[Observation], model_names: tuple[str, ...], kv_bucket: int = 0, pads_history: bool = True,
    residual_weight: float = 0.0,
) -> dict:
    """Prequential errors: {model: {"all"|"path=gpu"|"width=2"...: [abs rel errors]}}, the signed errors of "all"
    (positive: over-predicted) and of the contended observations (with their shapes, in the same order), plus
    prediction coverage. `kv_bucket`: count chunks as the engine pads them; `pads_history`: whether its chunk
    attention computed over the padded history (`SchedulerConfig.pads_history`); `residual_weight`: the affine
    model's `SchedulerConfig.cost_residual_weight`."""
    models = available_models(model_names, kv_bucket, pads_history, residual_weight)
    errors: dict[str, dict[str, list[float]]] = {m.name: defaultdict(list) for m in models}
    signed: dict[str, list[float]] = {m.name: [] for m in models}
    signed_contended: dict[str, list[float]] = {m.name: [] for m in models}
    contended_shapes: dict[str, list[StepShape]] = {m.name: [] for m in models}
    unpredicted: dict[str, int] = dict.fromkeys(errors, 0)
    for obs in found:
        trainable = is_trainable(obs.shape, obs.measured_ms)
        for model in models:
            predicted = model.predict(obs.shape)  # before observing: only earlier observations inform it
            if trainable:
                if predicted is None:
                    unpredicted[model.name] += 1
                else:
                    signed[model.name].append((predicted - obs.measured_ms) / obs.measured_ms)
                    if obs.contended:
                        signed_contended[model.name].append(signed[model.name][-1])
                        contended_shapes[model.name].append(obs.shape)
                    error = abs(signed[model.name][-1])
                    for key in ("all", f"path={obs.shape.path.value}", f"width={obs.shape.width}",
                                "contended" if obs.contended else "uncontended"):
                        errors[model.name][key].append(error)
            model.observe(obs.shape, obs.measured_ms)
    return {"errors": errors, "signed": signed, "signed_contended": signed_contended,
            "contended_shapes": contended_shapes, "unpredicted": unpredicted,
            "trainable": sum(is_trainable(o.shape, o.measured_ms) for o in found)}


def summarize(result: dict) -> list[dict]:
    rows = []
    for model, groups in result["errors"].items():
        for key in sorted(groups, key=lambda k: (k != "all", k)):
            values = groups[key]
            rows.append({"model": model, "group": key, "n": len(values),
                         "mean_abs_rel_error": sum(values) / len(values), "p95_abs_rel_error": percentile(values, 95)})
        if not groups:
            rows.append({"model": model, "group": "all", "n": 0, "mean_abs_rel_error": math.nan,
                         "p95_abs_rel_error": math.nan})
    return rows


def render(rows: list[dict], result: dict, skipped: int) -> str:
    out = [f"trainable prefill observations: {result['trainable']} (mixed-path steps skipped: {skipped})",
           "predictions unavailable (model untrained): "
           + ", ".join(f"{m} {n}" for m, n in result["unpredicted"].items()),
           "", "| model | group | n | mean abs rel err | p95 abs rel err |", "|---|---|---:|---:|---:|"]
    for row in rows:
        out.append(f"| {row['model']} | {row['group']} | {row['n']} | {100 * row['mean_abs_rel_error']:.2f}% | "
                   f"{100 * row['p95_abs_rel_error']:.2f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracing.prefill_prediction", description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="JSONL captures, replayed in the order given")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated cost model names")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    found, skipped = [], 0
    for trace in args.traces:
        try:
            capture = load(trace)
        except (CaptureError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if capture.refusal():
            print(f"error: refusing {trace}: {capture.refusal()}", file=sys.stderr)
            return 2
        more, more_skipped = observations(capture.events)
        found += more
        skipped += more_skipped
    result = replay(found, tuple(name.strip() for name in args.models.split(",") if name.strip()))
    rows = summarize(result)
    print(render(rows, result, skipped))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "unpredicted": result["unpredicted"],
                                         "trainable": result["trainable"], "skipped_mixed": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
