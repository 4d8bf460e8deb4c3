"""Engine-thread time of a long prompt's arrival in the scheduler: the step that first plans it, while 8 streams
decode. That time is spent between two of their tokens, so it belongs in the stream-gap budget.

Usage: `python benchmarks/scheduler_arrival.py [--lengths 8192,30000] [--repeats 9] [--json]`. Pure Python (no
MLX): for each prompt length, the median over repeats of `schedule()` + `update()` for the arrival step, with
no cached prefix (a new prompt) and with the whole prompt but its last block cached (a warm continuation).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import Request, Scheduler, SchedulerConfig, StepOutcome  # noqa: E402

STREAMS = 8


def _step(scheduler: Scheduler, now: float) -> None:
    plan = scheduler.schedule(now)
    scheduler.update(plan, StepOutcome({lane.request_id: 5 for lane in plan.lanes if lane.samples}, 20.0), now)


def arrival_ms(length: int, cached: bool, seed: int) -> float:
    """schedule() + update() of the step that first sees a `length`-token prompt, in milliseconds."""
    rng = random.Random(seed)
    config = SchedulerConfig(num_blocks=4 * length // 16 + 1024, max_model_len=2 * length, step_target_ms=50.0)
    scheduler = Scheduler(config)
    prompt = [rng.randrange(100, 100_000) for _ in range(length)]
    now = 0.0
    if cached:  # the same prompt ran before: its blocks are in the prefix cache
        scheduler.add(Request("earlier", list(prompt), 1))
        while scheduler.has_work:
            _step(scheduler, now)
            now += 0.02
    for i in range(STREAMS):
        scheduler.add(Request(f"stream{i}", [rng.randrange(100, 100_000) for _ in range(512)], 100_000))
    for _ in range(5):
        _step(scheduler, now)
        now += 0.02
    scheduler.add(Request("long", [*prompt[:-1], 7], 1))
    t0 = time.perf_counter()
    _step(scheduler, now)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,30000")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        for cached in (False, True):
            samples = [arrival_ms(length, cached, seed) for seed in range(args.repeats)]
            rows.append({"prompt_tokens": length, "cached_prefix": cached, "arrival_ms_p50": statistics.median(samples)})
    if args.json:
        print(json.dumps(rows))
        return
    print("| prompt tokens | cached prefix | arrival step ms (p50) |\n|---|---|---|")
    for row in rows:
        print(f"| {row['prompt_tokens']:,} | {'yes' if row['cached_prefix'] else 'no'} | {row['arrival_ms_p50']:.2f} |")


if __name__ == "__main__":
    main()
