"""`python -m benchmarks.gpu.contended_table RESULT.json[.gz]... [--by SETTING ...]`: the contended figures of recorded
GPU bench runs, one markdown row a run, then a summary by setting (how many met the gap target, the ratio's median
and range, the worst TTFT). An A/B on the device is several runs a side, interleaved: one run's ratio swings 2.1-7.3
with nothing changed (fortieth run), so the table is what is compared, not a single figure.

Each row: the run's label (its folder, or the file's name), the settings named in `--by`, the max gap over the median
gap (bold where within 3), the median and longest gaps, the 16k prompt's TTFT over its solo prefill (and both in
seconds: either may move the ratio, 30B-A3B's solo read 0.92-0.98 s in one session), the shared
prefix's warm over cold TTFT, the steps with prefill, the auto target at the pass's end, the contended steps planned
under the floor slack, as a stand-in's rows and in place of a first run (`+first-run`: whether `price_first_runs`
decided anything), the slowest step the longest-gap report lists (rows, form, ms), and the one-off steps: those
beside decode lanes that ran a shape for the first time, stood in for one or built a trace (`auxiliary`), how many,
the slowest (and why, in logs that say: "stand-in 1024x12288" replayed that trace's rows and history bucket), and the
slowest other step over the median gap (forty-third run: at 10-12 ms targets the one-off steps held the longest gap;
without them the slowest step was within 3 median gaps in 6 of 7 runs), and MLX's buffer cache at the pass's start
and end against the engine's cache limit (recorded from `19833a7` on; the sixtieth run's one slow 30B-A3B pass on the
H100 began with 2.0 GB cached where the others began with 6.4-6.5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.gpu.replay_cost_model import read_result

GAP_TARGET = 3.0  # issue 7: max gap at most 3x the median gap
TTFT_TARGET = 1.5  # ... and the long prompt's TTFT at most 1.5x its solo prefill
# a `prefill_steps` entry: [rows, decode lanes, history, ms, predicted ms, prefill lanes, auxiliary, compiled, why
# auxiliary (from the fifty-seventh run's code on)]
LANES, MS, AUXILIARY, WHY = 1, 3, 6, 8
# settings a result records, `--by` choices; traced_midpoints, met_midpoints and paced_slowdown only in older logs
SETTINGS = ("step_target_floor_ms", "traced_midpoints", "met_midpoints", "floor_slack", "budget_midpoints",
            "paced_slowdown", "price_first_runs", "warm_chunk_rows", "plan_headroom", "debt_tolerance",
            "price_stand_ins", "max_prefill_slowdown", "fill_stand_ins", "kept_traces_at",
            "time_idle_traces", "price_stand_in_runs")


def label_of(path: Path) -> str:
    """A device run's folder (`/root/r/LABEL/gpu_bench.json`), else the file's name without `gpu_bench_` and suffixes."""
    if path.name in ("gpu_bench.json", "gpu_bench.json.gz"):
        return path.parent.name
    return path.name.split(".")[0].removeprefix("gpu_bench_")


def run_row(label: str, shape: str, ours: dict, settings: tuple[str, ...]) -> dict | None:
    """One run's contended figures (None: the run has no contended pass)."""
    contended = ours.get("contended")
    if not contended or "gap_ratio" not in contended:
        return None
    steps = contended.get("steps", {})
    budgets = [b for b in steps.get("prefill_budgets", []) if b]
    longest = contended.get("longest_gap", {}).get("steps", [])
    slowest = max(longest, key=lambda s: s["ms"], default=None)
    solo = ours.get("prefill", {}).get("16384", {}).get("ttft_s")
    shared = ours.get("shared_prefix", {})
    first_pass = (ours.get("warm_passes") or [None])[0]
    return {
        "label": label,
        "shape": shape,
        "settings": {name: _setting(ours.get(name)) for name in settings},
        "ratio": contended["gap_ratio"],
        "median_ms": contended["gap_p50_ms"],
        "max_ms": contended["gap_max_ms"],
        "before_ms": contended.get("gap_max_before_ms"),
        "from_arrival_ms": contended.get("gap_max_from_arrival_ms"),
        "ttft": contended["long_ttft_s"] / solo if solo else None,
        "long_s": contended["long_ttft_s"],
        "solo_s": solo,
        # a fresh engine's first long prompt beside streams (recorded since the sixty-sixth session's code)
        "first_pass_ttft": first_pass["long_ttft_s"] / solo if solo and first_pass else None,
        "shared": shared["warm_ttft_s"] / shared["cold_ttft_s"] if shared.get("cold_ttft_s") else None,
        "steps": steps,
        "target_ms": ours.get("step_target_ms"),
        "slack_steps": sum("+slack" in b[1] for b in budgets if len(b) > 1 and b[1]),
        "stand_in_steps": sum("+stand-in" in b[1] for b in budgets if len(b) > 1 and b[1]),
        "first_run_steps": sum("+first-run" in b[1] for b in budgets if len(b) > 1 and b[1]),
        "slowest": slowest,
        "one_off": one_off_steps(steps.get("prefill_steps", []), contended["gap_p50_ms"]),
        "cache_mb": tuple(contended.get(key) for key in ("cache_start_mb", "cache_end_mb", "cache_limit_mb")),
    }


def one_off_steps(prefill_steps: list[list], median_gap_ms: float) -> dict:
    """The contended steps that ran a shape for the first time or built a trace, against the rest: how many, the
    slowest of each kind, and the slowest other step over the median gap (what the ratio would be at most without
    the one-off steps, were every gap a step)."""
    contended = [step for step in prefill_steps if step[LANES] > 0]
    one_off = [step for step in contended if step[AUXILIARY]]
    other = [step[MS] for step in contended if not step[AUXILIARY]]
    slowest = max(one_off, key=lambda step: step[MS], default=None)
    slowest_other = max(other, default=None)
    return {"count": len(one_off), "slowest_ms": None if slowest is None else slowest[MS],
            "slowest_why": slowest[WHY] if slowest is not None and len(slowest) > WHY else None,
            "other_ratio": slowest_other / median_gap_ms if slowest_other is not None and median_gap_ms else None}


def _setting(value: object) -> object:
    """A recorded setting as a group key: a list (`kept_traces_at`) as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def rows_of(paths: list[Path], settings: tuple[str, ...]) -> list[dict]:
    rows = []
    for path in paths:
        results = read_result(path).get("results", [])
        for result in results:
            label = label_of(path) + ("" if len(results) == 1 else f" {result['shape']}")
            row = run_row(label, result.get("shape", "?"), result.get("ours", {}), settings)
            if row is not None:
                rows.append(row)
    return rows


def _why(reason: str | None) -> str:
    """Why the slowest one-off step was one, where the log says (" (stand-in 1024x12288)")."""
    return f" ({reason})" if reason else ""


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[dict], settings: tuple[str, ...]) -> list[str]:
    head = ["run", "shape", *settings, "max gap / median", "median ms", "longest gap ms (before / from arrival)",
            "16k TTFT / solo (s / s)", "first warm pass's TTFT / solo", "shared prefix",
            "steps with prefill (count, rows p50, ms p50); decode-only (count, ms p50)",
            "target ms", "slack / stand-in / first-run steps", "slowest step at the longest gap",
            "one-off steps (count, slowest ms); slowest other / median", "MLX cache MB (start / end / limit)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ratio = _num(row["ratio"])
        steps, slowest = row["steps"], row["slowest"]
        cells = [
            row["label"], row["shape"], *(str(row["settings"][name]) for name in settings),
            f"**{ratio}**" if row["ratio"] <= GAP_TARGET else ratio, _num(row["median_ms"], 1),
            f"{_num(row['max_ms'], 1)} ({_num(row['before_ms'], 0)} / {_num(row['from_arrival_ms'], 0)})",
            f"{_num(row['ttft'])} ({_num(row['long_s'])} / {_num(row['solo_s'])})", _num(row["first_pass_ttft"]),
            _num(row["shared"]),
            f"{steps.get('mixed_steps', '-')}, {steps.get('mixed_rows_p50') or 0:,.0f}, "
            f"{_num(steps.get('mixed_ms_p50'), 1)}; {steps.get('decode_only_steps', '-')}, "
            f"{_num(steps.get('decode_only_ms_p50'))}",
            _num(row["target_ms"], 1), f"{row['slack_steps']} / {row['stand_in_steps']} / {row['first_run_steps']}",
            "-" if slowest is None else
            f"{slowest['prefill_rows']:,} {'compiled' if slowest['compiled'] else 'eager'}, {slowest['ms']:.1f}",
            f"{row['one_off']['count']}, {_num(row['one_off']['slowest_ms'], 1)}{_why(row['one_off']['slowest_why'])}; "
            f"{_num(row['one_off']['other_ratio'])}",
            " / ".join(_num(mb, 0) for mb in row["cache_mb"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(rows: list[dict], settings: tuple[str, ...]) -> list[str]:
    """Per shape and combination of the settings: runs, how many met the gap target (and TTFT), the ratio's median and range."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["shape"], *(row["settings"][name] for name in settings)), []).append(row)
    head = ["shape", *settings, "runs", "gap met", "TTFT met", "ratio median (range)", "worst TTFT"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, group in groups.items():
        ratios = [row["ratio"] for row in group]
        ttfts = [row["ttft"] for row in group if row["ttft"] is not None]
        lines.append("| " + " | ".join([
            *map(str, key), str(len(group)), str(sum(r <= GAP_TARGET for r in ratios)),
            str(sum(t <= TTFT_TARGET for t in ttfts)),
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            _num(max(ttfts, default=None)),
        ]) + " |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files (or .json.gz)")
    parser.add_argument("--by", nargs="*", default=["step_target_floor_ms", "plan_headroom"], choices=SETTINGS,
                        help="settings shown and grouped by (default: %(default)s)")
    args = parser.parse_args(argv)
    settings = tuple(args.by)
    rows = rows_of(args.results, settings)
    if not rows:
        print("no contended passes in these files", file=sys.stderr)
        return 1
    print("\n".join([*table(rows, settings), "", *summary(rows, settings)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
