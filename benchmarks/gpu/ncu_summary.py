"""Sum Nsight Compute's kernel times by kernel: where one profiled step's device time goes.

Reads the CSV of `ncu --csv --print-units base --metrics gpu__time_duration.sum ...` (stdin or a file) and prints
one JSON line a kernel name (calls, total and mean microseconds, share of the step), largest first, then the total.

    ncu --clock-control none --profile-from-start off --csv --print-units base \
        --metrics gpu__time_duration.sum python -m benchmarks.gpu.profile_step ... --cuda-profile \
        | python -m benchmarks.gpu.ncu_summary --label 8b-1-lane
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import defaultdict


def kernel_times(text: str) -> dict[str, list[float]]:
    """Kernel name (its first 80 characters) -> the microseconds of each call."""
    start = text.find('"ID"')
    if start < 0:
        return {}
    times: dict[str, list[float]] = defaultdict(list)
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3}.get(row["Metric Unit"], 1e-3)
        times[row["Kernel Name"][:80]].append(value * scale)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="the CSV (default: stdin)")
    parser.add_argument("--label", default="")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    text = open(args.path).read() if args.path else sys.stdin.read()
    times = kernel_times(text)
    total = sum(sum(calls) for calls in times.values())
    rows = sorted(times.items(), key=lambda item: -sum(item[1]))
    for name, calls in rows[: args.top]:
        print(json.dumps({"label": args.label, "kernel": name, "calls": len(calls), "us": round(sum(calls), 1),
                          "mean_us": round(sum(calls) / len(calls), 2), "share": round(sum(calls) / total, 3)}))  # fmt: skip
    launches = sum(len(calls) for calls in times.values())
    print(json.dumps({"label": args.label, "total_us": round(total, 1), "launches": launches}))


if __name__ == "__main__":
    main()
