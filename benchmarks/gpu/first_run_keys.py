"""What a mixed step's first run pays, and what it is keyed by: chunk rows, history bucket, or the pair.

On the H100 (0.6B beside 8 streams) a shape's first eager run read up to +10 ms over its price, and such steps held
most contended runs' longest gaps (NOTES, sessions 45-46). The engine counts a shape as met per (lanes, table width,
rows bucket, history bucket). If the one-off work (GEMM plans, kernel loads) follows the rows alone, warming each
rows bucket once at start-up would remove it at every history; if it follows the step's whole row count (decode
lanes + chunk rows), a warm-up at one lane count would not. This runs one runner's eager (fused) steps of decode
lanes (`--lanes`, or fewer where the sequence names them) and one chunk through a sequence of (rows, history[,
lanes]) shapes, each three times synchronously, and prints each shape's first, second and third step in ms with
what was new about it.

    python -m benchmarks.gpu.first_run_keys --shape 0.6b --lanes 8
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from benchmarks.gpu.models import dummy_and_layout
from benchmarks.gpu.profile_mixed import mixed_step_runner
from mlx_serve.runner import KV_BUCKET, history_bucket, query_bucket

# (rows, history): after a warm shape, one thing new at a time, then both
SEQUENCE = (
    (512, 1024),  # warm-up: every kernel's first use
    (512, 5120),  # a new history bucket, rows met
    (768, 5120),  # new rows, history met
    (768, 1024),  # rows and history both met, the pair new
    (384, 9216),  # both new
    (384, 9216 + KV_BUCKET),  # history new again, rows met once
    (1024, 2048),  # new rows at a new history
    (1024, 2048 + KV_BUCKET),
    (256, 12288),
    (256, 1024),
    (512, 1024, 4),  # rows and history met, fewer decode lanes: only the step's whole row count is new
    (512, 1024, 6),
    (768, 5120, 4),
)
REPEATS = 3


def probe(shape: str, lanes: int, variant: str, sequence: tuple[tuple[int, ...], ...] = SEQUENCE) -> list[dict]:
    """Each (rows, history[, lanes]) of `sequence` run `REPEATS` times in one runner, beside `lanes` decode lanes
    where an entry names none: its step times and what was new (rows bucket, history bucket, lane count; else the
    pair of buckets, else none)."""
    dummy, layout = dummy_and_layout(shape)
    entries = [(rows, history, *(given or (lanes,))) for rows, history, *given in sequence]
    rows_most, history_most = max(e[0] for e in entries), max(e[1] for e in entries)
    runner, plan = mixed_step_runner(
        dummy.model, layout, max(e[2] for e in entries), rows_most, history_most, variant, len(entries) * REPEATS
    )
    seen_rows: set[int] = set()
    seen_history: set[int] = set()
    seen_lanes: set[int] = set()
    seen_pairs: set[tuple[int, int]] = set()
    rows_out = []
    step = 0
    for rows, history, decode_lanes in entries:
        row_bucket, padded = query_bucket(rows), history_bucket(history + rows, KV_BUCKET)
        new = "+".join(name for name, fresh in (("rows", row_bucket not in seen_rows),
                                                ("history", padded not in seen_history),
                                                ("lanes", decode_lanes not in seen_lanes)) if fresh)  # fmt: skip
        new = new or ("pair" if (row_bucket, padded) not in seen_pairs else "none")
        times = []
        for _ in range(REPEATS):
            mx.synchronize()
            t0 = time.perf_counter()
            runner.collect(runner.submit(plan(step, rows, history, decode_lanes)))
            times.append(round(1e3 * (time.perf_counter() - t0), 2))
            step += 1
        seen_rows.add(row_bucket)
        seen_history.add(padded)
        seen_lanes.add(decode_lanes)
        seen_pairs.add((row_bucket, padded))
        rows_out.append({"rows": rows, "history": history, "lanes": decode_lanes, "rows_bucket": row_bucket,
                         "history_bucket": padded, "new": new, "ms": times,
                         "first_over_ms": round(times[0] - min(times[1:]), 2)})  # fmt: skip
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument(
        "--variants",
        default="fused",
        help="fused: eager steps (the engine's first runs); compiled: a trace a shape, traced on its first step",
    )
    args = parser.parse_args()
    for variant in args.variants.split(","):
        for row in probe(args.shape, args.lanes, variant):
            print(
                json.dumps({"shape": args.shape, "variant": variant, **row}), flush=True
            )
        mx.clear_cache()


if __name__ == "__main__":
    main()
