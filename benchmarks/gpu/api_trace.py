"""Which CUDA API calls hold the host inside a step's submission?

    python -m benchmarks.gpu.api_trace --shape 0.6b --lanes 8 --rows 1024 --history 8192 [--steps 12]

A compiled mixed step's submission is 2-3 ms of Python and then 5-20 ms inside `mx.async_eval`, growing with the
GPU work of the step before it (NOTES sessions 30-32): a wait on the device that is not `pthread_cond_wait`, not
MLX's graph cache and not its in-flight limit. This queues `profile_mixed`'s steps (the runner as the engine runs
it, one step in flight) with every CUDA driver and runtime API call of the process timed through CUPTI
(`api_calls.c`), and prints one JSON object a line:
- for each range (the engine thread's submissions and read-backs) and call: calls, total / p50 / max ms;
- each range's own p50 / max ms;
- the slowest calls inside submissions, with their step.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.gpu.api_calls import ApiCall, ApiCalls

RANGES = ("submit", "collect")


@dataclass(frozen=True, slots=True)
class Span:
    kind: str  # "submit" or "collect"
    step: int
    start: float  # perf_counter seconds
    end: float
    tid: int


def summarize(calls: Sequence[ApiCall], spans: Sequence[Span], slowest: int = 15) -> list[dict]:
    """Per (range kind, call): calls, total, p50 and max ms; each kind's spans; the `slowest` calls in submissions.
    A call counts in the span of its own thread that holds it whole."""
    durations: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    in_submit = []
    for call in calls:
        span = next((s for s in spans if s.tid == call.tid and s.start <= call.start and call.end <= s.end), None)
        if span is None:
            continue
        ms = 1e3 * (call.end - call.start)
        durations[(span.kind, f"{call.domain}:{call.name}")].append(ms)
        if span.kind == "submit":
            in_submit.append({"step": span.step, "call": f"{call.domain}:{call.name}", "ms": round(ms, 3)})
    rows = []
    for (kind, name), values in sorted(durations.items(), key=lambda item: -sum(item[1])):
        rows.append({"range": kind, "call": name, "calls": len(values), "total_ms": round(sum(values), 3),
                     "p50_ms": round(statistics.median(values), 3), "max_ms": round(max(values), 3)})  # fmt: skip
    for kind in RANGES:
        lengths = [1e3 * (s.end - s.start) for s in spans if s.kind == kind]
        if lengths:
            rows.append({"range": kind, "spans": len(lengths), "p50_ms": round(statistics.median(lengths), 3),
                         "max_ms": round(max(lengths), 3)})  # fmt: skip
    in_submit.sort(key=lambda call: -call["ms"])
    rows.append({"slowest_in_submit": in_submit[:slowest]})
    return rows


def traced_steps(args: argparse.Namespace, api: ApiCalls) -> list[Span]:
    """Queue the steps one in flight with the API calls timed; the engine thread's spans."""
    from benchmarks.gpu.models import dummy_and_layout
    from benchmarks.gpu.profile_mixed import WARMUP, mixed_step_runner

    dummy, layout = dummy_and_layout(args.shape)
    runner, plan = mixed_step_runner(dummy.model, layout, args.lanes, args.rows, args.history, args.variant,
                                     args.steps)  # fmt: skip
    for step in range(WARMUP):  # traces and kernels compiled before the timing
        runner.collect(runner.submit(plan(step)))
    tid, spans = threading.get_native_id(), []

    def timed(kind: str, step: int, work):
        start = time.perf_counter()
        result = work()
        spans.append(Span(kind, step, start, time.perf_counter(), tid))
        return result

    result = api.start(args.min_us)
    if result != 0:
        sys.exit(f"CUPTI refused the subscription (CUptiResult {result})")
    in_flight = None
    for step in range(WARMUP, WARMUP + args.steps):
        current = timed("submit", step, lambda step=step, flight=in_flight: runner.submit(plan(step), flight))
        if in_flight is not None:
            timed("collect", step - 1, lambda flight=in_flight: runner.collect(flight))
        in_flight = current
    timed("collect", WARMUP + args.steps - 1, lambda: runner.collect(in_flight))
    api.stop()
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variant", default="compiled", choices=("modules", "fused", "compiled"))
    parser.add_argument("--min-us", type=float, default=0.0, help="time only calls at least this long")
    args = parser.parse_args()
    api, reason = ApiCalls.load()
    if api is None:
        sys.exit(f"api_trace: {reason}")
    spans = traced_steps(args, api)
    base = {"shape": args.shape, "lanes": args.lanes, "rows": args.rows, "history": args.history,
            "variant": args.variant, "dropped": api.dropped()}  # fmt: skip
    for row in summarize(api.read(), spans):
        print(json.dumps(base | row), flush=True)


if __name__ == "__main__":
    main()
