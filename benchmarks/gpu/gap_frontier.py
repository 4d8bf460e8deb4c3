"""`python -m benchmarks.gpu.gap_frontier RESULT.json[.gz]...`: for each recorded contended run, the least max-gap /
median-gap ratio its own step costs allow while the long prompt's TTFT stays within 1.5x of its solo prefill.

Issue 7 asks for both at once: the longest inter-token gap of the decoding streams at most 3x their median (a decode
step), and the 16k prompt read within 1.5x its solo time. Every step that reads a chunk is a gap, so the gap limit
caps a step's cost, and the TTFT limit needs the prompt read in few enough such steps. This prices a step
from the run's own compiled steps with one chunk beside its decode lanes: their decode-only step (p50) as the fixed
part, and ms a thousand rows and a million attention pairs (padded as the engine pads) fitted to the rest by least
squares. The engine's live affine fit is not used: its steps all carry 8 lanes and one chunk, so it cannot tell the
fixed part from the lanes' and the trace's, and it prices a 64-row mixed step under a decode step. Then it plans the
prompt greedily under a step limit: at each history, the widest query bucket priced within the limit. The smallest
limit whose steps sum within the TTFT allowance, over the run's median gap, is the frontier: under it no chunking
meets both targets at the costs the run measured. A bound from a fit, not a measurement: it leaves out the
decode-only steps and host waits a live pass adds (both make the real ratio worse), and the fit's error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from benchmarks.gpu.contended_table import GAP_TARGET, TTFT_TARGET, label_of
from benchmarks.gpu.replay_cost_model import read_result, recorded_run
from scheduler.affine_cost import features
from scheduler.buckets import KV_BUCKET, query_buckets
from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.plan import Path as LanePath

WIDEST_ROWS = 4096  # the bench's prefill chunk cap (`SchedulerConfig.max_prefill_rows`)

# (rows, history) -> predicted ms, None where the price is unknown
Price = Callable[[int, int], float | None]


def read_steps(price: Price, rows: int, history: int, limit_ms: float, ceiling: int) -> list[tuple[int, float]] | None:
    """The steps, (rows, predicted ms), that read `rows` prompt rows from `history`, each the widest query bucket (at
    most `ceiling` rows, or the rows left) priced within `limit_ms`; None where even the narrowest is not, or a price
    is unknown. A step costs more the longer the history, so the widest fitting bucket only narrows as the read goes."""
    buckets = query_buckets(ceiling)
    index, done, steps = len(buckets) - 1, 0, []
    while done < rows:
        left = rows - done
        if index + 1 < len(buckets) and left < min(buckets[index + 1], ceiling):
            # the rest is narrower than the narrowest width refused: it may fit whole
            cost = price(left, history + done)
            if cost is None:
                return None
            if cost <= limit_ms:
                steps.append((left, cost))
                break
        while index >= 0:
            take = min(buckets[index], ceiling, left)
            cost = price(take, history + done)
            if cost is None:
                return None
            if cost <= limit_ms:
                break
            index -= 1
        if index < 0:
            return None
        steps.append((take, cost))
        done += take
    return steps


class Frontier(NamedTuple):
    label: str
    median_ms: float  # the run's median gap (a decode step)
    price: StepPrice
    ratio: float  # the run's measured max gap / median gap
    ttft: float  # the run's measured 16k TTFT / solo
    least_ratio: float | None  # the least step limit / median gap meeting the TTFT allowance (None: none up to 20x)
    steps_at_target: int | None  # steps the prompt takes under a limit of 3 median gaps (None: 64 rows do not fit)
    ttft_at_target: float | None  # their summed cost / the solo TTFT


class StepPrice(NamedTuple):
    fixed_ms: float  # the run's decode-only step: a step with a chunk costs at least that
    row_ms: float  # ms a thousand padded rows
    pair_ms: float  # ms a million padded attention pairs
    fitted_steps: int
    error_ms: float  # the fit's mean absolute error over them

    def of(self, rows: int, history: int, lanes: int) -> float:
        shape = StepShape((PrefillChunk(rows, history),), lanes, LanePath.GPU, compiled=True)
        _, rows_k, pairs_m, *_ = features(shape, KV_BUCKET)
        return self.fixed_ms + self.row_ms * rows_k + self.pair_ms * pairs_m


def step_price(result: dict) -> StepPrice | None:
    """The run's compiled one-chunk steps beside its decode lanes (warm pass and measured), priced with the fixed
    part pinned to its decode-only step (None: fewer than 3 such steps)."""
    ours, run = result.get("ours", {}), recorded_run(result)
    fixed = ours.get("contended", {}).get("steps", {}).get("decode_only_ms_p50")
    lanes = result.get("contended_streams", 8)
    if run is None or not fixed:
        return None
    points = []
    for found in run.observations:
        shape = found.shape
        if shape.compiled and not shape.auxiliary and shape.decode_lanes == lanes and len(shape.chunks) == 1:
            _, rows_k, pairs_m, *_ = features(shape, KV_BUCKET)
            points.append((rows_k, pairs_m, found.measured_ms - fixed))
    if len(points) < 3:
        return None
    row_ms, pair_ms = _least_squares(points)
    price = StepPrice(fixed, row_ms, pair_ms, len(points), 0.0)
    error = sum(abs(fixed + row_ms * r + pair_ms * p - (y + fixed)) for r, p, y in points) / len(points)
    return price._replace(error_ms=error)


def _least_squares(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """y = a r + b p over (r, p, y), a and b at least 0 (a negative one is dropped and the other refitted)."""
    srr = sum(r * r for r, _, _ in points)
    spp = sum(p * p for _, p, _ in points)
    srp = sum(r * p for r, p, _ in points)
    sry = sum(r * y for r, _, y in points)
    spy = sum(p * y for _, p, y in points)
    determinant = srr * spp - srp * srp
    if determinant > 0:
        a, b = (sry * spp - spy * srp) / determinant, (spy * srr - sry * srp) / determinant
        if a >= 0 and b >= 0:
            return a, b
    # one term alone, whichever fits better
    a, b = max(sry, 0.0) / srr if srr else 0.0, max(spy, 0.0) / spp if spp else 0.0
    residual_a = sum((y - a * r) ** 2 for r, _, y in points)
    residual_b = sum((y - b * p) ** 2 for _, p, y in points)
    return (a, 0.0) if residual_a <= residual_b else (0.0, b)


def prompt_steps(price: StepPrice, prompt: int, lanes: int, limit_ms: float) -> list[float] | None:
    """The priced steps that read `prompt` tokens, each the widest chunk within `limit_ms` (None: 64 rows do not),
    planned greedily (`read_steps`)."""
    steps = read_steps(lambda rows, history: price.of(rows, history, lanes), prompt, 0, limit_ms, WIDEST_ROWS)
    return None if steps is None else [cost for _, cost in steps]


def least_limit(price: StepPrice, prompt: int, lanes: int, allowed_ms: float, low: float, high: float) -> float | None:
    """The smallest step limit in [low, high] whose steps read the prompt within `allowed_ms` (bisection: a wider
    limit never takes more steps, and the costs it sums only come with fewer of them)."""
    def meets(limit: float) -> bool:
        costs = prompt_steps(price, prompt, lanes, limit)
        return costs is not None and sum(costs) <= allowed_ms

    if not meets(high):
        return None
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def frontier(label: str, result: dict) -> Frontier | None:
    ours = result.get("ours", {})
    contended, solo = ours.get("contended"), ours.get("prefill", {}).get("16384", {}).get("ttft_s")
    price = step_price(result)
    if not contended or "gap_ratio" not in contended or not solo or price is None:
        return None
    median, lanes, prompt = contended["gap_p50_ms"], result.get("contended_streams", 8), result.get("contended_long", 16384)
    allowed = TTFT_TARGET * solo * 1e3
    least = least_limit(price, prompt, lanes, allowed, median, 20 * median)
    at_target = prompt_steps(price, prompt, lanes, GAP_TARGET * median)
    return Frontier(
        label, median, price, contended["gap_ratio"], contended["long_ttft_s"] / solo,
        None if least is None else least / median,
        None if at_target is None else len(at_target),
        None if at_target is None else sum(at_target) / (solo * 1e3),
    )  # fmt: skip


def frontiers(paths: list[Path]) -> list[Frontier]:
    found = []
    for path in paths:
        results = read_result(path).get("results", [])
        for result in results:
            label = label_of(path) + ("" if len(results) == 1 else f" {result['shape']}")
            row = frontier(label, result)
            if row is not None:
                found.append(row)
    return found


def _num(value: float | int | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files (or .json.gz)")
    args = parser.parse_args(argv)
    rows = frontiers(args.results)
    if not rows:
        print("no contended run with recorded steps in these files", file=sys.stderr)
        return 1
    print("| run | median gap ms | step price: fixed + ms a k rows + ms a M pairs (steps, mean abs error) | measured "
          "ratio / TTFT | least ratio with TTFT <= 1.5x | steps, TTFT at a 3x limit |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        price = row.price
        print(f"| {row.label} | {row.median_ms:.1f} | {price.fixed_ms:.2f} + {price.row_ms:.2f} + {price.pair_ms:.3f} "
              f"({price.fitted_steps}, {price.error_ms:.2f}) | {row.ratio:.2f} / {row.ttft:.2f} | {_num(row.least_ratio)} | "
              f"{_num(row.steps_at_target)}, {_num(row.ttft_at_target)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
