"""`python -m benchmarks.gpu.replay_budgets RESULT.json[.gz]...`: the budget today's scheduler chooses at each
contended state of recorded GPU bench runs, beside the rows that ran there.

The engine records what its cost model was shown (`cost_observations`). Replayed in order through a fresh affine
model, each measured-pass step of decode lanes beside one prefill chunk is a state: the model trained on the steps
before it, the long prompt's rows left at that chunk's history, the run's step target (`step_target_ms`, recorded at
the run's end) and its scheduler settings. At each state this asks `slack_allowance_ms` and `choose_row_budget` what
they choose now. Which shapes had a compiled trace is approximated: a rows bucket counts as traced once a step of it
ran compiled beside decode lanes. The replay follows the recorded steps, not its own choices, so it shows where a
decision would change and ranks policies; it does not predict a run.

`--from-first-pass` takes the states of every contended pass (the warm passes too: the first one starts from a
fit that has seen only solo prefill, as a server's first long prompt beside streams does), and `--target-ms` replays
at another step target: a run records only the target it had learned by its end, and an early pass ran at the one
its decode steps had taught it by then.

`--set NAME=VALUE` replays under another value of a recorded setting (`SETTINGS`), so a policy is ranked on every
recorded run before it takes device time. The last column prices the chosen rows by what such steps measured: the
median time of the recorded steps of the same shape (every run given) in the same cell (rows bucket, decode lanes,
form, `HISTORY_CELL` of history), over the states whose cell holds at least `LEAST_CELL_STEPS` of them. The
predicted read time alone would credit a policy whose fit under-prices its steps.

    python -m benchmarks.gpu.replay_budgets benchmarks/gpu/logs/gpu_bench_fortyninth_f*.json.gz [--steps]
        [--set floor_slack=2.0] [--from-first-pass --target-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import NamedTuple

from benchmarks.gpu.contended_table import label_of
from benchmarks.gpu.replay_cost_model import live_observations, read_result
from benchmarks.scheduler_sim import config_override
from mlx_serve.commands.serve import positive_float_arg
from scheduler import SchedulerConfig
from scheduler.affine_cost import AffineCostModel
from scheduler.buckets import KV_BUCKET, query_bucket
from scheduler.budget import (
    choose_row_budget,
    fill_shortest_first,
    floor_step_ms,
    slack_allowance_ms,
    slack_guard_ms,
)
from scheduler.cost_models import PrefillChunk

PROMPT_TOKENS = 16_384  # the bench's long prompt
# the recorded settings the budget reads, by their `SchedulerConfig` names
SETTINGS = ("row_quantum", "budget_midpoints", "checked_fill", "plan_headroom",
            "cost_trust_factor", "cost_residual_weight", "floor_slack", "slack_guard_rows",
            "max_prefill_slowdown", "untrained_rows")  # fmt: skip
# what a run made before a setting was recorded ran at (its default then), where today's default differs
UNRECORDED = {"cost_residual_weight": 0.0}
HISTORY_CELL = 2048  # tokens of history a measured-cost cell spans
LEAST_CELL_STEPS = 2  # recorded steps a cell needs to price a state

# (query bucket of the prefill rows, decode lanes, compiled, history // HISTORY_CELL)
Cell = tuple[int, int, bool, int]


class Replayed(NamedTuple):
    history: int
    ran_rows: int
    ran_ms: float
    rows: int  # the budget chosen now
    predicted_ms: float | None
    allowance_ms: float
    reason: str
    cell: Cell | None = None  # where the chosen step's measured cost is looked up
    # what the floor slack weighs: the floor step's price, the slack guard's step's (compiled where prefill is)
    floor_ms: float | None = None
    guard_ms: float | None = None


def cell_of(rows: int, decode_lanes: int, compiled: bool, history: int) -> Cell:
    return query_bucket(rows), decode_lanes, compiled, history // HISTORY_CELL


def replay_run(
    ours: dict, prompt_tokens: int = PROMPT_TOKENS, overrides: dict | None = None, from_first_pass: bool = False,
    target_ms: float | None = None,
) -> list[Replayed]:
    """Today's decision at each contended one-chunk state of one run (`ours`: a result's own side), under the
    recorded settings with `overrides` (`SchedulerConfig` names) in their place: the measured pass's states, or
    every pass's (`from_first_pass`); at the run's recorded step target or at `target_ms`."""
    scored_from = 0 if from_first_pass else ours.get("contended", {}).get("cost_observations_from", 0)
    found = live_observations(ours.get("cost_observations", []), scored_from)
    recorded = {name: ours[name] for name in SETTINGS if ours.get(name) is not None}
    settings = UNRECORDED | recorded | (overrides or {})
    config = SchedulerConfig(num_blocks=1 << 20, kv_bucket=KV_BUCKET, **settings)
    model = AffineCostModel(KV_BUCKET, config.cost_trust_factor, bool(ours.get("pads_history", True)),
                            config.cost_residual_weight)  # fmt: skip
    target_ms = ours["step_target_ms"] if target_ms is None else target_ms
    traced_buckets: set[int] = set()

    def traced(chunks) -> bool:
        return len(chunks) == 1 and query_bucket(chunks[0].rows) in traced_buckets

    replayed = []
    for observation in found:
        shape = observation.shape
        one_chunk = len(shape.chunks) == 1 and shape.decode_lanes > 0
        if observation.contended and one_chunk and shape.chunks[0].history < prompt_tokens:
            history = shape.chunks[0].history
            demand = [PrefillChunk(prompt_tokens - history, history)]
            allowance = slack_allowance_ms(config, model, demand, shape.decode_lanes, target_ms, traced)
            decision = choose_row_budget(
                config, model, demand, shape.decode_lanes, False, True, target_ms, traced, allowance
            )
            chosen = fill_shortest_first(demand, decision.row_budget)  # the prompt's tail: fewer rows than the budget
            cell = cell_of(chosen[0].rows, shape.decode_lanes, traced(chosen), history) if chosen else None
            # what the floor slack weighed
            prices = (price(config, model, demand, shape.decode_lanes, traced)
                      for price in (floor_step_ms, slack_guard_ms))  # fmt: skip
            replayed.append(Replayed(history, shape.prefill_rows, observation.measured_ms, decision.row_budget,
                                     decision.predicted_ms, allowance, decision.reason, cell, *prices))  # fmt: skip
        if shape.compiled and one_chunk:
            traced_buckets.add(query_bucket(shape.prefill_rows))
        model.observe(shape, observation.measured_ms)
    return replayed


def measured_cells(runs: Iterable[dict]) -> dict[Cell, float]:
    """The median measured time of each cell's recorded steps (decode lanes beside one chunk, no one-off work)
    over `runs` (results' own sides), for the cells with at least `LEAST_CELL_STEPS` of them."""
    found: dict[Cell, list[float]] = defaultdict(list)
    for ours in runs:
        for observation in live_observations(ours.get("cost_observations", []), 0):
            shape = observation.shape
            if len(shape.chunks) == 1 and shape.decode_lanes > 0 and not shape.auxiliary:
                chunk = shape.chunks[0]
                found[cell_of(chunk.rows, shape.decode_lanes, shape.compiled, chunk.history)].append(
                    observation.measured_ms
                )
    return {cell: statistics.median(times) for cell, times in found.items() if len(times) >= LEAST_CELL_STEPS}


def measured_read_s(
    replayed: list[Replayed], cells: dict[Cell, float], prompt_tokens: int
) -> tuple[float | None, int]:
    """The prompt's read time at the chosen rows' measured rate (rows over ms, summed over the states whose cell
    was measured), and how many states were priced."""
    priced = [(min(r.rows, prompt_tokens - r.history), cells[r.cell]) for r in replayed if r.cell in cells]
    rows, ms = sum(p[0] for p in priced), sum(p[1] for p in priced)
    return (prompt_tokens * ms / rows / 1000 if rows else None), len(priced)


def summary(
    label: str, shape: str, replayed: list[Replayed], prompt_tokens: int = PROMPT_TOKENS,
    cells: dict[Cell, float] | None = None,
) -> str:  # fmt: skip
    """One markdown row: the rows that ran and the rows chosen now (the three most common), the allowance, the
    prompt's read time at the chosen steps' predicted rate (rows a predicted ms, averaged over the states), and at
    their measured cost (`measured_read_s`; `-` without `cells`)."""
    rates = [r.rows / r.predicted_ms for r in replayed if r.predicted_ms]
    read_s = prompt_tokens / statistics.mean(rates) / 1000 if rates else None
    common = lambda rows: ", ".join(f"{n} x{count}" for n, count in Counter(rows).most_common(3))  # noqa: E731
    allowance = statistics.median(r.allowance_ms for r in replayed)
    measured_s, priced = measured_read_s(replayed, cells or {}, prompt_tokens)
    measured = "-" if measured_s is None else f"{measured_s:.2f} ({priced})"
    return (f"| {label} | {shape} | {len(replayed)} | {common(r.ran_rows for r in replayed)} | "
            f"{common(r.rows for r in replayed)} | {allowance:.1f} | {'-' if read_s is None else f'{read_s:.2f}'} | "
            f"{measured} |")  # fmt: skip


def setting(text: str) -> tuple[str, object]:
    """`NAME=VALUE` for `--set`: a `SETTINGS` name (on or off for a switch), its value parsed as the simulator's
    `--set` parses a `SchedulerConfig` field."""
    name, _, value = text.partition("=")
    if name not in SETTINGS:
        names = ", ".join(SETTINGS)
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {names}, got {text!r}")
    if isinstance(SchedulerConfig.__dataclass_fields__[name].default, bool) and value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{name} takes on or off, got {value!r}")
    return config_override(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files (or .json.gz)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--steps", action="store_true", help="also print every state's decision")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="NAME=VALUE",
                        help=f"replay under this value of a recorded setting ({', '.join(SETTINGS)})")
    parser.add_argument("--from-first-pass", action="store_true",
                        help="the states of every contended pass, the warm passes' too (default: the measured one)")
    parser.add_argument("--target-ms", type=partial(positive_float_arg, expected="milliseconds"), default=None,
                        help="replay at this step target (default: the one the run had learned by its end)")
    args = parser.parse_args(argv)
    recorded = [(label_of(path), result) for path in args.results
                for result in read_result(path).get("results", [])]  # fmt: skip
    by_shape: dict[str, list[dict]] = defaultdict(list)
    for _, result in recorded:
        by_shape[result["shape"]].append(result.get("ours", {}))
    cells = {shape: measured_cells(runs) for shape, runs in by_shape.items()}
    rows = []
    for label, result in recorded:
        ours = result.get("ours", {})
        if not ours.get("cost_observations") or "step_target_ms" not in ours:
            continue
        replayed = replay_run(ours, args.prompt_tokens, dict(args.set), args.from_first_pass, args.target_ms)
        for state in replayed if args.steps else ():
            print(f"{label} {state.history:>6} ran {state.ran_rows:>5} in {state.ran_ms:6.1f} ms | now "
                  f"{state.rows:>5} ({state.reason}, {state.predicted_ms or 0:.1f} of {state.allowance_ms:.1f} ms)"
                  f" | floor {state.floor_ms or 0:.1f}, guard {state.guard_ms or 0:.1f} ms")  # fmt: skip
        if replayed:
            rows.append(summary(label, result["shape"], replayed, args.prompt_tokens, cells[result["shape"]]))
    if not rows:
        print("no recorded contended states in these files", file=sys.stderr)
        return 1
    print("| run | shape | states | rows that ran | rows chosen now | allowance ms p50 | read s at chosen rows "
          "| read s at their measured cost (states priced) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
