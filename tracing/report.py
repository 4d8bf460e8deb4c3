"""`python -m tracing.report TRACE`: latency report of one capture, plus a PNG timeline.

Refuses (exit 2) a capture that overflowed, did not end cleanly, or whose request events do not add up.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from tracing import analysis
from tracing import events as ev
from tracing.jsonl import CaptureError, load


def build_report(events: list[object]) -> dict:
    timelines = analysis.request_timelines(events)
    requests = []
    for line in sorted(timelines.values(), key=lambda x: (x.arrival or 0.0, x.request_id)):
        gaps = analysis.Distribution.of([g * 1000 for g in line.gaps_s])
        requests.append({
            "request_id": line.request_id,
            "prompt_tokens": line.prompt_tokens,
            "output_tokens": len(line.token_times),
            "cached_tokens": line.cached_tokens,
            "reason": line.reason,
            "ttft_ms": None if line.ttft_s is None else line.ttft_s * 1000,
            "gap_p50_ms": gaps.p50, "gap_p95_ms": gaps.p95, "gap_max_ms": gaps.max,
        })
    return {
        "requests": requests,
        "steps": step_rows(events),
        "committed_tokens": sum(len(line.token_times) for line in timelines.values()),
        "step_time_by_geometry": [asdict(g) for g in analysis.step_time_by_geometry(events)],
        "engine_gaps": {k: asdict(v) for k, v in analysis.engine_gaps(events, timelines).items()},
        "budget": asdict(analysis.budget_summary(events)),
        "spans": {k: asdict(v) for k, v in analysis.span_totals(events).items()},
    }


def step_rows(events: list[object]) -> list[dict]:
    """Every step as planned (budget, halvings, lanes after the cut) and as executed (rows, path, times)."""
    planned = {e.step_id: e for e in events if isinstance(e, ev.StepPlanned)}
    rows = []
    for step in (e for e in events if isinstance(e, ev.StepExecuted)):
        plan = planned.get(step.step_id)
        rows.append({
            "step_id": step.step_id, "end_s": step.t, "rows": step.rows, "prefill_rows": step.prefill_rows,
            "decode_lanes": step.decode_lanes, "prefill_width": step.prefill_width,
            "weighted_history": step.weighted_history, "path": step.path, "predicted_ms": step.predicted_ms,
            "measured_ms": step.measured_ms, "row_budget": plan.row_budget if plan else None,
            "budget_reason": plan.budget_reason if plan else None, "halvings": plan.halvings if plan else None,
            "lanes": [asdict(lane) for lane in plan.lanes] if plan else [],
        })
    return rows


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def render_text(report: dict) -> str:
    out = ["## Requests", "| request | prompt | output | cached | reason | TTFT ms | gap p50 | gap p95 | gap max |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in report["requests"]:
        out.append(f"| {r['request_id']} | {r['prompt_tokens']} | {r['output_tokens']} | {r['cached_tokens']} | "
                   f"{r['reason']} | {fmt(r['ttft_ms'])} | {fmt(r['gap_p50_ms'])} | {fmt(r['gap_p95_ms'])} | "
                   f"{fmt(r['gap_max_ms'])} |")
    out += ["", f"committed tokens: {report['committed_tokens']}", "", "## Step time by geometry",
            "| path | prefill rows | width | decode lanes | steps | p50 ms | p95 ms | max ms | pred. err |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for g in report["step_time_by_geometry"]:
        t = g["time_ms"]
        out.append(f"| {g['path']} | {g['prefill_rows']} | {g['prefill_width']} | {g['decode_lanes']} | {t['count']} "
                   f"| {fmt(t['p50'])} | {fmt(t['p95'])} | {fmt(t['max'])} | {fmt(100 * g['mean_abs_rel_error'])}% |")
    out += ["", "## Gaps between steps", "| kind | count | p50 ms | p95 ms | max ms | total ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for kind, d in report["engine_gaps"].items():
        label = "while requests active" if kind == "active_ms" else "idle (no requests)"
        out.append(f"| {label} | {d['count']} | {fmt(d['p50'], 2)} | {fmt(d['p95'], 2)} | {fmt(d['max'], 2)} | "
                   f"{fmt(d['total'])} |")
    b = report["budget"]
    out += ["", "## Row budget",
            f"steps {b['steps']}, contended {b['contended_steps']}, halved {b['halved_steps']}, "
            f"halvings {b['total_halvings']}; budgets {b['budgets']}; reasons {b['reasons']}",
            "", "## Spans", "| span | count | p50 ms | p95 ms | max ms | total ms |", "|---|---:|---:|---:|---:|---:|"]
    for name, d in report["spans"].items():
        label = f"{name} (host notification/report interval)" if name.startswith("ane") else name
        out.append(f"| {label} | {d['count']} | {fmt(d['p50'], 2)} | {fmt(d['p95'], 2)} | {fmt(d['max'], 2)} | "
                   f"{fmt(d['total'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracing.report", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a JSONL capture (MLX_SERVE_TRACE or serve --trace)")
    parser.add_argument("--png", type=Path, help="timeline image (default: TRACE with .timeline.png)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--no-png", action="store_true", help="skip the timeline image")
    args = parser.parse_args(argv)
    try:
        capture = load(args.trace)
    except (CaptureError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = [capture.refusal()] if capture.refusal() else []
    problems += analysis.consistency_problems(analysis.request_timelines(capture.events))
    if problems:
        print(f"error: refusing to report on {args.trace}:", file=sys.stderr)
        for problem in problems[:20]:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    report = build_report(capture.events)
    print(render_text(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if not args.no_png:
        from tracing.timeline import draw_timeline

        png = args.png or args.trace.with_suffix(".timeline.png")
        draw_timeline(capture.events, analysis.request_timelines(capture.events), png, title=args.trace.name)
        print(f"\ntimeline: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
