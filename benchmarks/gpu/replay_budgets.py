"""`python -m benchmarks.gpu.replay_budgets RESULT.json[.gz]...`: the budget today's scheduler chooses at each
contended state of recorded GPU bench runs, beside the rows that ran there.

The engine records what its cost model was shown (`cost_observations`). Replayed in order through a fresh affine
model, each measured-pass step of decode lanes beside one prefill chunk is a state: the model trained on the steps
before it, the long prompt's rows left at that chunk's history, the run's step target (`step_target_ms`, recorded at
the run's end) and its scheduler settings. At each state this asks `slack_allowance_ms` and `choose_row_budget` what
they choose now. Which shapes had a compiled trace is approximated: a rows bucket counts as traced once a step of it
ran compiled beside decode lanes. The replay follows the recorded steps, not its own choices, so it shows where a
decision would change and ranks policies; it does not predict a run.

    python -m benchmarks.gpu.replay_budgets benchmarks/gpu/logs/gpu_bench_fortysixth_c84_*.json.gz [--steps]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from benchmarks.gpu.contended_table import label_of
from benchmarks.gpu.replay_cost_model import live_observations, read_result
from scheduler import SchedulerConfig
from scheduler.affine_cost import AffineCostModel
from scheduler.buckets import KV_BUCKET, query_bucket
from scheduler.budget import choose_row_budget, slack_allowance_ms
from scheduler.cost_models import PrefillChunk

PROMPT_TOKENS = 16_384  # the bench's long prompt
# the recorded settings the budget reads, by their `SchedulerConfig` names
SETTINGS = ("row_quantum", "budget_midpoints", "checked_fill", "plan_headroom",
            "cost_trust_factor", "floor_slack", "slack_guard_rows", "max_prefill_slowdown")  # fmt: skip


class Replayed(NamedTuple):
    history: int
    ran_rows: int
    ran_ms: float
    rows: int  # the budget chosen now
    predicted_ms: float | None
    allowance_ms: float
    reason: str


def replay_run(ours: dict, prompt_tokens: int = PROMPT_TOKENS) -> list[Replayed]:
    """Today's decision at each contended one-chunk state of one run (`ours`: a result's own side)."""
    scored_from = ours.get("contended", {}).get("cost_observations_from", 0)
    found = live_observations(ours.get("cost_observations", []), scored_from)
    settings = {name: ours[name] for name in SETTINGS if ours.get(name) is not None}
    config = SchedulerConfig(num_blocks=1 << 20, kv_bucket=KV_BUCKET, **settings)
    model = AffineCostModel(KV_BUCKET, config.cost_trust_factor, pads_history=bool(ours.get("pads_history", True)))
    target_ms = ours["step_target_ms"]
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
            replayed.append(Replayed(history, shape.prefill_rows, observation.measured_ms, decision.row_budget,
                                     decision.predicted_ms, allowance, decision.reason))  # fmt: skip
        if shape.compiled and one_chunk:
            traced_buckets.add(query_bucket(shape.prefill_rows))
        model.observe(shape, observation.measured_ms)
    return replayed


def summary(label: str, shape: str, replayed: list[Replayed], prompt_tokens: int = PROMPT_TOKENS) -> str:
    """One markdown row: the rows that ran and the rows chosen now (the three most common), the allowance, and the
    prompt's read time at the chosen steps' predicted rate (rows a predicted ms, averaged over the states)."""
    rates = [r.rows / r.predicted_ms for r in replayed if r.predicted_ms]
    read_s = prompt_tokens / statistics.mean(rates) / 1000 if rates else None
    common = lambda rows: ", ".join(f"{n} x{count}" for n, count in Counter(rows).most_common(3))  # noqa: E731
    allowance = statistics.median(r.allowance_ms for r in replayed)
    return (f"| {label} | {shape} | {len(replayed)} | {common(r.ran_rows for r in replayed)} | "
            f"{common(r.rows for r in replayed)} | {allowance:.1f} | {'-' if read_s is None else f'{read_s:.2f}'} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="gpu_bench.json files (or .json.gz)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--steps", action="store_true", help="also print every state's decision")
    args = parser.parse_args(argv)
    rows = []
    for path in args.results:
        label = label_of(path)
        for result in read_result(path).get("results", []):
            ours = result.get("ours", {})
            if not ours.get("cost_observations") or "step_target_ms" not in ours:
                continue
            replayed = replay_run(ours, args.prompt_tokens)
            for state in replayed if args.steps else ():
                print(f"{label} {state.history:>6} ran {state.ran_rows:>5} in {state.ran_ms:6.1f} ms | now "
                      f"{state.rows:>5} ({state.reason}, {state.predicted_ms or 0:.1f} of {state.allowance_ms:.1f} ms)")  # fmt: skip
            if replayed:
                rows.append(summary(label, result["shape"], replayed, args.prompt_tokens))
    if not rows:
        print("no recorded contended states in these files", file=sys.stderr)
        return 1
    print("| run | shape | states | rows that ran | rows chosen now | allowance ms p50 | read s at chosen rows |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
