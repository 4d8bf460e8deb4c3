"""How long the scheduler takes to plan a cached prefix's continuation (no MLX, seconds on a CPU).

A request whose prompt repeats a finished one's (a chat's next turn over its history) is matched against the prefix
cache before its first step is planned, on the engine thread, while every stream waits. This times that plan
(`Scheduler.schedule`, p50 over `--rounds` continuations) with remembered hash chains (`SchedulerConfig.
recent_chain_tokens`, the default) and without (every block hashed again, as before `scheduler/chain_memo.py`), and
what remembering costs when a request finishes.

    python benchmarks/prefix_planning.py --prefix 8192,30720
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from scheduler import Request, Scheduler, SchedulerConfig, StepOutcome, StepPlan


def outcome_of(plan: StepPlan) -> StepOutcome:
    return StepOutcome({lane.request_id: 1 for lane in plan.lanes if lane.samples}, 10.0)


def finish(scheduler: Scheduler, now: float) -> None:
    """Run the scheduler's steps until nothing is left."""
    plan = scheduler.schedule(now)
    while plan.lanes:
        scheduler.update(plan, outcome_of(plan), now)
        plan = scheduler.schedule(now)


def continuation_plan_ms(prefix_len: int, recent_chain_tokens: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    blocks = 2 * (prefix_len + 64 * rounds) // 16 + 64
    config = SchedulerConfig(num_blocks=blocks, block_size=16, row_ceiling=2048, recent_chain_tokens=recent_chain_tokens)
    scheduler = Scheduler(config)
    prefix = [rng.randrange(150_000) for _ in range(prefix_len)]
    scheduler.add(Request("cold", [*prefix, *range(32)], max_tokens=1))
    finish(scheduler, 0.0)
    plans, updates = [], []
    for i in range(rounds):
        scheduler.add(Request(f"warm{i}", [*prefix, *(rng.randrange(1000) for _ in range(32))], max_tokens=1))
        t0 = time.perf_counter()
        plan = scheduler.schedule(1.0 + i)
        plans.append(time.perf_counter() - t0)
        outcome = outcome_of(plan)
        t0 = time.perf_counter()
        scheduler.update(plan, outcome, 1.0 + i)
        updates.append(time.perf_counter() - t0)
        finish(scheduler, 1.0 + i)
    return {
        "prefix": prefix_len,
        "recent_chain_tokens": recent_chain_tokens,
        "plan_ms_p50": round(1e3 * statistics.median(plans), 3),
        "update_ms_p50": round(1e3 * statistics.median(updates), 3),  # the continuation finishing: remembered there
        "recalled_blocks": scheduler.stats.recalled_hash_blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="8192,30720", help="cached prefix lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for prefix_len in (int(n) for n in args.prefix.split(",")):
        for recent in (1 << 18, 0):
            print(json.dumps(continuation_plan_ms(prefix_len, recent, args.rounds, args.seed)), flush=True)


if __name__ == "__main__":
    main()
