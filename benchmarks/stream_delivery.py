"""The engine thread's cost of delivering tokens to streams read on an event loop, as the server reads them.

    python benchmarks/stream_delivery.py --streams 8,32,64 --max-tokens 128 [--json]

Runs the built-in dummy model with N greedy requests submitted and read with `async for` on one asyncio loop (the
server's way), and reports, per step of N decode lanes, the engine's `application` phase (the tokens' events built
and handed to their streams, p50 ms), the `delivery` spans' total per step (events handed to the loop after the
step, where an `Outbox` holds them), its whole step (p50 ms) and tokens/s. The application phase is host time on
the one thread that also builds every step, so at many streams on a small model it bounds the step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tracing.events import Span, StepExecuted
from tracing.sink import MemorySink


async def _read_all(engine: Engine, streams: int, max_tokens: int) -> int:
    """Submit on this loop and read every stream to its end; returns the tokens read."""
    handles = [
        engine.submit(GenerationRequest(prompt_ids=tuple(range(5 + i, 69 + i)), max_tokens=max_tokens, ignore_eos=True))
        for i in range(streams)
    ]

    async def read(handle) -> int:
        return sum([1 async for event in handle if event.token_id is not None])

    return sum(await asyncio.gather(*(read(h) for h in handles)))


def measure(engine: Engine, sink: MemorySink, streams: int, max_tokens: int) -> dict:
    asyncio.run(_read_all(engine, streams, 4))  # warm: the step shapes of this many lanes
    sink.events.clear()
    t0 = time.perf_counter()
    tokens = asyncio.run(_read_all(engine, streams, max_tokens))
    elapsed = time.perf_counter() - t0
    events = list(sink.events)
    full = {e.step_id: e for e in events if isinstance(e, StepExecuted) and e.decode_lanes == streams and not e.prefill_rows}
    application = [1e3 * (e.end - e.start) for e in events if isinstance(e, Span) and e.name == "application" and e.step_id in full]
    # the events handed to the loops after each step and admission pass (since `Outbox`; before, in `application`)
    delivery = [1e3 * (e.end - e.start) for e in events if isinstance(e, Span) and e.name == "delivery"]
    steps = sorted(e.t for e in full.values())
    gaps = [1e3 * (b - a) for a, b in zip(steps, steps[1:])]
    return {
        "streams": streams, "tokens": tokens, "tok_s": round(tokens / elapsed, 1),
        "application_ms_p50": round(statistics.median(application), 3) if application else None,
        "delivery_ms_per_step": round(sum(delivery) / len(full), 3) if full else None,
        "step_ms_p50": round(statistics.median(gaps), 3) if gaps else None, "steps": len(full),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="8,32,64", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sink = MemorySink()
    engine = Engine.load(EngineConfig(max_running=64, trace=sink))
    try:
        rows = [measure(engine, sink, int(n), args.max_tokens) for n in args.streams.split(",") if n]
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(rows))
    else:
        print("| streams | tok/s | step ms p50 | application ms p50 | delivery ms / step |\n|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['streams']} | {row['tok_s']:,} | {row['step_ms_p50']} | {row['application_ms_p50']} "
                  f"| {row['delivery_ms_per_step']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
