"""How far over its price a contended step's first eager run went, split by whether what it met had run before.

Every bench result records the last warm pass's and the measured pass's steps with prefill (`prefill_steps`: rows,
decode lanes, history, ms, predicted ms, prefill lanes, one-off, compiled). For each one-off eager step of the
measured pass this asks whether its rows bucket (at any lane count), its rows bucket at its lane count, or its
exact row count with its lanes, had run in an earlier step, and prints the excess over price by answer.

    python -m benchmarks.gpu.first_run_logs benchmarks/gpu/logs/gpu_bench_forty*_*.json.gz --shape 0.6b
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.gpu.replay_cost_model import read_result
from scheduler.buckets import query_bucket

# what a step met: rows and decode lanes -> a key that repeats where that part of the work repeats
KEYS: dict[str, Callable[[int, int], object]] = {
    "rows bucket": lambda rows, lanes: query_bucket(rows),
    "rows bucket and lanes": lambda rows, lanes: (query_bucket(rows), lanes),
    "rows and lanes": lambda rows, lanes: rows + lanes,
}


def first_run_excess(results: Iterable[dict], shape: str) -> dict[tuple[str, bool], list[float]]:
    """(key, whether it had run before) -> each one-off eager step's measured minus predicted ms."""
    excess: dict[tuple[str, bool], list[float]] = {}
    for result in results:
        ours = result.get("ours", {})
        if result.get("shape") != shape or "contended" not in ours:
            continue
        warm = ours.get("contended_warm", {}).get("steps", {}).get("prefill_steps", [])
        measured = ours["contended"]["steps"]["prefill_steps"]
        seen: dict[str, set] = {name: {key(s[0], s[1]) for s in warm} for name, key in KEYS.items()}
        for rows, lanes, _history, ms, predicted, _chunks, one_off, compiled, *_why in measured:  # why: from 57th
            if one_off and predicted and not compiled:
                for name, key in KEYS.items():
                    excess.setdefault((name, key(rows, lanes) in seen[name]), []).append(ms - predicted)
            for name, key in KEYS.items():
                seen[name].add(key(rows, lanes))
    return excess


def table(excess: dict[tuple[str, bool], list[float]]) -> str:
    lines = ["| met before | key | steps | ms over price: median | p75 | max |", "|---|---|---|---|---|---|"]
    for (name, met), values in sorted(excess.items()):
        ordered = sorted(values)
        lines.append(f"| {'yes' if met else 'no'} | {name} | {len(ordered)} | {statistics.median(ordered):.1f} | "
                     f"{ordered[3 * len(ordered) // 4]:.1f} | {ordered[-1]:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--skip", nargs="*", default=[], help="logs to leave out (a name contains one of these)")
    args = parser.parse_args()
    paths = [p for p in args.logs if not any(s in p.name for s in args.skip)]
    print(table(first_run_excess((r for p in paths for r in read_result(p)["results"]), args.shape)))


if __name__ == "__main__":
    main()
