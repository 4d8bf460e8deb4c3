"""Scheduler policy simulation: replay an arrival trace through `scheduler.Scheduler` on a virtual clock.

Usage: `python benchmarks/scheduler_sim.py` replays a seeded synthetic trace (Poisson arrivals, a mix of short
and long prompts) through each policy and prints, per policy, short and long TTFT, p95/max stream gap and
throughput; `--json` prints JSON instead. `--trace FILE` replays a recorded trace instead (JSONL, one arrival per
line: {"t": seconds, "prompt_tokens": n, "max_tokens": n, "priority": 0-2 optional}). Step times come from a
synthetic cost function (fixed + per row + per attention pair + per decode lane, with seeded log-normal noise;
flags `--ms-*`), so no GPU is involved: it runs on the CPU in seconds and is how a policy change is argued
before GPU time is spent. `--policies ema,bucketed,...` picks policies (see POLICIES); `--step-target-ms`,
`--num-blocks` and the trace flags shape the scenario. `--kv-bucket N` runs steps as the engine runs them on CUDA
(each chunk's rows padded to its query bucket, the step's rows to `--row-tile`) and lets the scheduler plan so
(`SchedulerConfig.kv_bucket`, `row_quantum`); `--ms-prefill-fixed` adds a cost to every step with prefill (a 4-bit
model's dequantized weights). With `--eager-extra-ms` a step of decode lanes and one chunk whose padded shape has no
compiled trace costs that much more, and the scheduler sees which shapes are traced, as on CUDA: shapes met (or
wanted) in the `--warm-passes` runs of the trace before the measured one are traced, as the idle engine traces them
between the GPU bench's passes; with `--stand-ins` an untraced such step replays a larger trace run within its limit
(or within `--stand-in-build-ms`, the engine's eager-build bound), as the engine's stand-ins do (its time is that
trace's rows'), and `--traced ROWS:HISTORY:MS` (repeatable) sets the
traces and their last runs the measured pass starts with (a run's `compiled_mixed.runs_ms`, in place of what the warm
passes traced). `--ms-prefill-host` makes a step with prefill take at least that long (its host
submission, which bounds a small model's mixed steps: H200 0.6B 8-12 ms), `--ms-solo-extra` adds to an
uncontended prefill step (no decode lanes; on the H100 0.6B's ran ~6 ms over its contended steps' price), and `--set FIELD=VALUE` sets a
`SchedulerConfig` field over every policy (`--set step_target_floor_ms=12`). A trace with a long prompt (`--long-threshold`) also gets the GPU bench's contended figures: the
streams' longest gap over their median from 16 tokens before its arrival to 16 after its first token, and its TTFT
over its TTFT alone. Results are only as good as the cost function: confirm a winner with the serving A/B harness
or the GPU bench on real hardware.

    # 8 streams, then a 16k prompt, at H200 8B 4-bit-like costs (twenty-ninth run's full run)
    python benchmarks/scheduler_sim.py --trace benchmarks/traces/contended_16k.jsonl --policies \
        affine-auto-target,affine-auto-target-checked-fill --kv-bucket 1024 --row-tile 64 --ms-fixed 5 \
        --ms-decode-lane 0.19 --ms-prefill-fixed 6 --ms-row 0.024 --ms-pair 1.56e-6 [--eager-extra-ms 12 --warm-passes 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.workloads import BenchParams, gap_summary  # noqa: E402  (no MLX import)
from mlx_serve.engine_setup import CHECKED_FLOOR_SLACK  # noqa: E402  (no MLX import)
from scheduler import LaneKind, Request, Scheduler, SchedulerConfig, StepOutcome, StepPlan  # noqa: E402
from scheduler.buckets import history_bucket, query_bucket  # noqa: E402
from scheduler.config import COST_MODEL_ENV  # noqa: E402
from scheduler.cost_models import PrefillChunk  # noqa: E402
from scheduler.plan import Lane  # noqa: E402
from scheduler.traced_shapes import StandIn  # noqa: E402

# name -> overrides of the base SchedulerConfig
POLICIES: dict[str, dict] = {
    "ema": {"cost_model": "ema"},
    "bucketed": {"cost_model": "bucketed"},
    "affine": {"cost_model": "affine"},
    "ema-no-debt": {"cost_model": "ema", "decode_debt": False},
    "ceiling-only": {"cost_model": "ema", "step_target_ms": 1e12},  # never halves: the no-budget baseline
    # the engine's `--step-target-ms auto`: 3 measured decode-only steps (at least 20 ms) instead of a fixed value
    "ema-auto-target": {"cost_model": "ema", "step_target_factor": 3.0},
    # the row-tile fill unchecked, as the engine ran before the thirtieth run (the figures in RESULTS until then)
    "affine-auto-target": {"cost_model": "affine", "step_target_factor": 3.0, "checked_fill": "off"},
    "affine-auto-target-checked-fill": {"cost_model": "affine", "step_target_factor": 3.0, "checked_fill": "on"},
    # the engine's defaults since the thirtieth run where a row tile is on: the fill checked, the floor slack wider
    "affine-auto-target-checked-wide": {"cost_model": "affine", "step_target_factor": 3.0, "checked_fill": "on",
                                        "floor_slack": CHECKED_FLOOR_SLACK},
    "affine-auto-target-checked-untraced": {"cost_model": "affine", "step_target_factor": 3.0,
                                            "checked_fill": "untraced"},
}


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float
    prompt_tokens: int
    max_tokens: int
    priority: int = 1


@dataclass(frozen=True)
class CostFunction:
    # roughly an Apple-GPU-class machine on a mid-size model: 2,048 rows at 16k history ~ 0.7 s
    fixed_ms: float = 15.0
    row_ms: float = 0.2
    pair_ms: float = 8e-6  # per attention pair: rows x (history + rows / 2)
    decode_lane_ms: float = 0.6
    noise: float = 0.08  # sigma of the log-normal multiplier
    prefill_fixed_ms: float = 0.0  # added to a step with prefill rows (a 4-bit model dequantizing its weights)
    kv_bucket: int = 0  # > 0: each chunk runs padded to its query bucket, as the engine pads on CUDA
    row_tile: int = 1  # the step's rows run in GEMM tiles of this many
    eager_extra_ms: float = 0.0  # with kv_bucket: added to a step of decode lanes and one chunk that has no trace
    prefill_host_ms: float = 0.0  # the least a step with prefill takes: its host submission (H200 0.6B: 8-12 ms)
    # a step whose host submission stalls: this fraction of steps take stall_ms more (H100 0.6B: 25-50 ms, a few a run)
    stall_rate: float = 0.0
    stall_ms: float = 0.0
    # with kv_bucket: added to such an eager step whose shape runs for the first time (one-off builds: H100 0.6B,
    # first eager 1,536-row steps 3-16 ms over their predictions; fortieth run)
    first_run_ms: float = 0.0
    # added to a step with prefill and no decode lanes (an uncontended, ceiling-sized chunk): on the H100 0.6B's such
    # steps ran ~6 ms over what its contended steps' price gives (solo 16k 195-210 ms against ~150 priced)
    solo_extra_ms: float = 0.0
    # a chunk's rows cost in whole granules of this many (H100 8B 4-bit: 384 and 512 rows beside 8 decode lanes ran
    # in one time, sixtieth run), a rate the affine fit's one rows slope cannot follow; 1: every row its own
    row_granule: int = 1

    def step_ms(self, plan: StepPlan, rng: random.Random, eager: bool = False, first_run: bool = False) -> float:
        """`eager`: a compilable step whose shape has no trace (it pays `eager_extra_ms`); `first_run`: its shape's
        first eager run (it also pays `first_run_ms`)."""
        decode_lanes = sum(1 for lane in plan.lanes if lane.kind is LaneKind.DECODE)
        chunks = [lane for lane in plan.lanes if lane.kind is not LaneKind.DECODE]
        padded = [query_bucket(lane.rows) if self.kv_bucket else lane.rows for lane in chunks]
        granules = sum(-(-chunk_rows // self.row_granule) * self.row_granule for chunk_rows in padded)
        rows = -(-(decode_lanes + granules) // self.row_tile) * self.row_tile
        pairs = sum(lane.history + 0.5 for lane in plan.lanes if lane.kind is LaneKind.DECODE) + sum(
            padded_rows * (lane.history + lane.rows / 2) for padded_rows, lane in zip(padded, chunks))
        base = (self.fixed_ms + self.row_ms * rows + self.pair_ms * pairs + self.decode_lane_ms * decode_lanes
                + (self.prefill_fixed_ms if chunks else 0.0))
        if eager:
            base += self.eager_extra_ms + (self.first_run_ms if first_run else 0.0)
        if chunks and not decode_lanes:
            base += self.solo_extra_ms
        if chunks:
            base = max(base, self.prefill_host_ms)
        stalled = self.stall_rate > 0 and rng.random() < self.stall_rate  # no draw without stalls: same runs as before
        return base * math.exp(rng.gauss(0.0, self.noise)) + (self.stall_ms if stalled else 0.0)


@dataclass
class SimTraces:
    """The engine's compiled mixed shapes as the scheduler asks about them (`scheduler.traced_shapes`): a step of
    decode lanes and one chunk of 2+ rows, keyed by the chunk's query bucket and history bucket. Shapes met or
    wanted become traced at `settle` (the idle engine tracing between passes, each trace run there once)."""

    kv_bucket: int
    shapes: set[tuple[int, int]] = field(default_factory=set)
    pending: set[tuple[int, int]] = field(default_factory=set)  # met or wanted, traced at `settle`
    ran_eager: set[tuple[int, int]] = field(default_factory=set)
    # with stand-ins, an untraced step replays the traced shape of the fewest rows, then the nearest history bucket, at
    # or past its own whose last ordinary run (`runs`, ms) was within the step's limit or `eager_build_ms` (the
    # engine's eager-build bound: 64-81 ms on 30B-A3B / H100, past a 67 ms limit) (`CompiledMixed.stand_in`)
    stand_ins: bool = False
    runs: dict[tuple[int, int], float] = field(default_factory=dict)
    eager_build_ms: float = 0.0

    def _key(self, chunks: Sequence[PrefillChunk], decode: Sequence) -> tuple[int, int] | None:
        if len(chunks) != 1 or chunks[0].rows < 2 or not decode:
            return None
        return query_bucket(chunks[0].rows), history_bucket(chunks[0].history + chunks[0].rows, self.kv_bucket)

    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence) -> bool:
        key = self._key(chunks, decode)
        return key is not None and key in self.shapes

    def met(self, chunks: Sequence[PrefillChunk], decode: Sequence) -> bool:
        key = self._key(chunks, decode)
        return key is None or key in self.shapes or key in self.ran_eager

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence) -> None:
        key = self._key(chunks, decode)
        if key is not None:
            self.pending.add(key)

    def stand_in(self, chunks: Sequence[PrefillChunk], decode: Sequence, limit_ms: float | None) -> StandIn | None:
        """As `TracedMixedShapes.stand_in`: the most rows a trace standing in for the step carries."""
        key = self._key(chunks, decode)
        if key is None or key in self.shapes:
            return None
        history = chunks[0].history
        within = [k for k in self._stand_ins_for(key, limit_ms) if self.runs[k] <= limit_ms]
        for rows, bucket in sorted(within, key=lambda k: (-min(k[0], k[1] - history), k[1])):
            carried = min(rows, bucket - history)
            grown = (query_bucket(carried), history_bucket(history + carried, self.kv_bucket))
            replayed = grown if grown in self.shapes else self.replayed(grown, limit_ms)
            ms = None if replayed is None else self.runs.get(replayed)
            if ms is not None and ms <= limit_ms:  # its own trace may be a slower one
                return StandIn(carried, ms)
        return None

    def stand_in_run_ms(self, chunks: Sequence[PrefillChunk], decode: Sequence, limit_ms: float) -> float | None:
        """As `TracedMixedShapes.stand_in_run_ms`: the last run of the trace an untraced step would replay."""
        near = self._stood_in_for(self._key(chunks, decode), limit_ms)
        return None if near is None else self.runs.get(near)

    def _stand_ins_for(self, key: tuple[int, int], limit_ms: float | None) -> list[tuple[int, int]]:
        if not self.stand_ins or limit_ms is None:
            return []
        bound = max(limit_ms, self.eager_build_ms)
        return [k for k, ms in self.runs.items() if k != key and k[0] >= key[0] and k[1] >= key[1] and ms <= bound]

    def replayed(self, key: tuple[int, int], limit_ms: float | None) -> tuple[int, int] | None:
        """The trace an untraced step of `key` replays in its place (None: it runs eager)."""
        return min(self._stand_ins_for(key, limit_ms), default=None)

    def meet(self, plan: StepPlan) -> bool | None:
        """Record the step's shape as met (traced at the next `settle`); whether the step replays a trace now
        (None: it is not a step the engine compiles)."""
        key = self._key(*_chunks_and_decode(plan))
        if key is None:
            return None
        self.pending.add(key)
        return key in self.shapes

    def stand_in_run(self, plan: StepPlan) -> tuple[int, int] | None:
        """The trace an untraced step replays in its place, within its limit (None: it runs as its own shape)."""
        return self._stood_in_for(self._key(*_chunks_and_decode(plan)), plan.limit_ms)

    def _stood_in_for(self, key: tuple[int, int] | None, limit_ms: float | None) -> tuple[int, int] | None:
        """The trace a step of `key` replays in place of its own (None: it has its own, or runs eager)."""
        return None if key is None or key in self.shapes else self.replayed(key, limit_ms)

    def record_run(self, plan: StepPlan, elapsed_ms: float, replayed: tuple[int, int] | None = None) -> None:
        """An ordinary run of a step that replayed its own trace, or the trace `replayed` in its place (a stand-in
        runs that trace as it runs for its own steps, as the engine records it)."""
        key = replayed or self._key(*_chunks_and_decode(plan))
        if key is not None:
            self.runs[key] = elapsed_ms

    def first_eager_run(self, plan: StepPlan) -> bool:
        """Whether the step, run eager, is its shape's first eager run (recorded)."""
        key = self._key(*_chunks_and_decode(plan))
        first = key is not None and key not in self.ran_eager
        self.ran_eager.add(key)
        return first

    def settle(self) -> None:
        self.shapes |= self.pending


def _padded_to(plan: StepPlan, rows: int, bucket: int | None = None) -> StepPlan:
    """`plan` with its one prefill chunk padded to `rows` rows and, given the history `bucket` of a trace standing in,
    to that history (what the trace computes: its rows over its whole padded history, as on the device)."""
    def padded(lane: Lane) -> Lane:
        start = lane.start if bucket is None else max(lane.start, bucket - rows)
        return replace(lane, token_ids=lane.token_ids + (0,) * (rows - lane.rows), start=start)

    return replace(plan, lanes=tuple(lane if lane.kind is LaneKind.DECODE else padded(lane) for lane in plan.lanes))


def _chunks_and_decode(plan: StepPlan) -> tuple[list, list]:
    chunks = [PrefillChunk(rows=lane.rows, history=lane.history) for lane in plan.lanes if lane.kind is not LaneKind.DECODE]
    return chunks, [lane for lane in plan.lanes if lane.kind is LaneKind.DECODE]


@dataclass
class Tracked:
    arrival: Arrival
    token_times: list[float] = field(default_factory=list)


def synthetic_trace(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while t < args.duration_s:
        t += rng.expovariate(args.rate)
        long = rng.random() < args.long_fraction
        prompt = rng.randint(8_000, 30_000) if long else rng.randint(100, 1_500)
        arrivals.append(Arrival(t, prompt, rng.randint(64, args.max_tokens)))
    return arrivals


def load_trace(path: Path) -> list[Arrival]:
    arrivals = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            arrivals.append(Arrival(float(row["t"]), int(row["prompt_tokens"]), int(row["max_tokens"]),
                                    int(row.get("priority", 1))))
    return sorted(arrivals, key=lambda a: a.t)


def simulate(
    config: SchedulerConfig, arrivals: list[Arrival], cost: CostFunction, seed: int, warm_passes: int = 0,
    stand_ins: bool = False, traced: dict[tuple[int, int], float] | None = None, eager_build_ms: float = 0.0,
) -> dict:
    """Run the trace to completion on a virtual clock, after `warm_passes` runs of it on the same scheduler (its
    cost model learns, the engine traces what they met); returns the last run's per-request token times and step
    counters. `stand_ins`: untraced steps replay larger traces (`SimTraces`); `traced`: the shapes traced beside decode
    lanes when the measured run starts, whatever the warm runs met, (query bucket, history bucket) -> last run's ms;
    `eager_build_ms`: a stand-in may also be a trace that ran within it (the engine's eager-build bound)."""
    traces = None
    if cost.kv_bucket and (cost.eager_extra_ms or cost.first_run_ms):
        traces = SimTraces(cost.kv_bucket, stand_ins=stand_ins, eager_build_ms=eager_build_ms)
    scheduler = Scheduler(config, traced_shapes=traces)
    rng = random.Random(seed)
    now = 0.0
    for index in range(warm_passes):
        now = _run_pass(scheduler, arrivals, cost, rng, traces, now, f"w{index}-")["end"] + 1.0
        if traces is not None:
            traces.settle()
    if traces is not None and traced:  # a trace set of the engine's as recorded (`compiled_mixed.runs_ms`)
        traces.shapes, traces.runs, traces.pending = set(traced), dict(traced), set()
    before = scheduler.stats.as_dict()
    result = _run_pass(scheduler, arrivals, cost, rng, traces, now, "")
    stats = {name: value - before[name] for name, value in result["stats"].items()}  # the measured pass's own
    return result | {"end": result["end"] - now, "stats": stats}


def _run_pass(
    scheduler: Scheduler, arrivals: list[Arrival], cost: CostFunction, rng: random.Random,
    traces: SimTraces | None, start: float, prefix: str,
) -> dict:
    tracked: dict[str, Tracked] = {}
    pending = list(reversed([replace(arrival, t=arrival.t + start) for arrival in arrivals]))
    now, refused = start, 0
    while pending or scheduler.has_work:
        while pending and pending[-1].t <= now:
            arrival = pending.pop()
            request_id = f"{prefix}r{len(tracked) + refused}"
            # unique tokens per request: the simulation measures scheduling, not prefix-cache luck
            prompt = [hash((request_id, i)) & 0xFFFF for i in range(arrival.prompt_tokens)]
            try:
                scheduler.add(Request(request_id, prompt, arrival.max_tokens, priority=arrival.priority,
                                      arrival_time=arrival.t))
                tracked[request_id] = Tracked(arrival)
            except Exception:  # QueueFull / RequestTooLarge: counted, not served
                refused += 1
        plan = scheduler.schedule(now)
        if plan.is_empty:
            if not pending:
                break
            now = max(now, pending[-1].t)
            continue
        compiled = traces.meet(plan) if traces is not None else None
        replayed = traces.stand_in_run(plan) if compiled is False else None
        if replayed is not None:  # a stand-in costs its trace's rows and trains nothing
            elapsed_ms = cost.step_ms(_padded_to(plan, *replayed), rng)
            outcome_flags = {"auxiliary": True, "compiled": True}
            traces.record_run(plan, elapsed_ms, replayed)
        else:
            first = compiled is False and traces.first_eager_run(plan)  # as the engine: its time trains no cost model
            elapsed_ms = cost.step_ms(plan, rng, eager=compiled is False, first_run=first)
            outcome_flags = {"auxiliary": first, "first_run": first, "compiled": compiled is True}
            if compiled:
                traces.record_run(plan, elapsed_ms)
        now += elapsed_ms / 1000.0
        sampled = {lane.request_id: 1 for lane in plan.lanes if lane.samples}
        outcome = StepOutcome(sampled, elapsed_ms, **outcome_flags)
        for request in scheduler.update(plan, outcome, now):
            tracked[request.request_id].token_times.append(now)
    return {"tracked": tracked, "refused": refused, "end": now, "stats": scheduler.stats.as_dict()}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(result: dict, long_threshold: int) -> dict:
    short_ttft, long_ttft, gaps, tokens = [], [], [], 0
    for item in result["tracked"].values():
        if not item.token_times:
            continue
        ttft = item.token_times[0] - item.arrival.t
        (long_ttft if item.arrival.prompt_tokens >= long_threshold else short_ttft).append(ttft)
        gaps += [b - a for a, b in zip(item.token_times, item.token_times[1:])]
        tokens += len(item.token_times)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    stats = result["stats"]
    return {
        "requests": len(result["tracked"]),
        "refused": result["refused"],
        "short_ttft_mean_s": mean(short_ttft),
        "short_ttft_p95_s": percentile(short_ttft, 95),
        "long_ttft_mean_s": mean(long_ttft),
        "long_ttft_p95_s": percentile(long_ttft, 95),
        "gap_p95_ms": 1000 * percentile(gaps, 95),
        "gap_max_ms": 1000 * max(gaps, default=math.nan),
        "output_tok_per_s": tokens / result["end"] if result["end"] else math.nan,
        "prefill_rows_per_s": stats["prefill_rows"] / result["end"] if result["end"] else math.nan,
        "steps": stats["steps"],
        "halvings": stats["budget_halvings"],
        "debt_steps": stats["decode_debt_steps"],
        "preemptions": stats["preemptions"],
    }


def solo_ttft(config: SchedulerConfig, long: Arrival, cost: CostFunction, seed: int, warm_passes: int) -> float:
    """A long prompt's TTFT alone on the engine (after the same warm passes of it alone): the bench's solo prefill."""
    result = simulate(config, [replace(long, t=0.0)], cost, seed, warm_passes)
    [item] = result["tracked"].values()
    return item.token_times[0] - item.arrival.t


def contended_figures(result: dict, long_threshold: int) -> dict | None:
    """The GPU bench's contended figures for the trace's first long prompt, by its arithmetic (`gap_summary`): the
    streams' gaps from its `tokens_before` tokens before the prompt's arrival to `tokens_after` after its first token,
    and its TTFT. None without a long prompt."""
    items = [item for item in result["tracked"].values() if item.token_times]
    longs = [item for item in items if item.arrival.prompt_tokens >= long_threshold]
    if not longs:
        return None
    long = min(longs, key=lambda item: item.arrival.t)
    arrival, first = long.arrival.t, long.token_times[0]
    window = BenchParams()
    gaps = []
    for item in items:
        if item is long or item.arrival.t > arrival:
            continue
        before = [t for t in item.token_times if t <= arrival][-window.tokens_before :]
        during = [t for t in item.token_times if arrival < t <= first]
        after = [t for t in item.token_times if t > first][: window.tokens_after]
        times = before + during + after
        gaps += [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return None
    summary = gap_summary(gaps, [])
    return {name: summary[name] for name in ("gap_ratio", "gap_p50_ms", "gap_max_ms")} | {
        "long_ttft_s": first - arrival, "long_arrival": long.arrival}


def render(rows: dict[str, dict]) -> str:
    columns = [("short TTFT mean/p95 s", "short_ttft_mean_s", "short_ttft_p95_s"),
               ("long TTFT mean/p95 s", "long_ttft_mean_s", "long_ttft_p95_s"),
               ("gap p95/max ms", "gap_p95_ms", "gap_max_ms")]
    head = "| policy | " + " | ".join(c[0] for c in columns) + " | out tok/s | steps | halvings | debt | preempt |"
    contended = all(row.get("contended") for row in rows.values())
    if contended:
        head += " window gap max / median | long TTFT / solo |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, row in rows.items():
        pairs = [f"{row[a]:.2f} / {row[b]:.2f}" if "ttft" in a else f"{row[a]:.0f} / {row[b]:.0f}"
                 for _, a, b in columns]
        line = (f"| {name} | " + " | ".join(pairs) + f" | {row['output_tok_per_s']:.1f} | {row['steps']} | "
                f"{row['halvings']} | {row['debt_steps']} | {row['preemptions']} |")
        if contended:
            figures = row["contended"]
            line += (f" {figures['gap_ratio']:.2f} ({figures['gap_max_ms']:.1f} / {figures['gap_p50_ms']:.1f} ms)"
                     f" | {figures['long_ttft_vs_solo']:.2f}x |")
        lines.append(line)
    return "\n".join(lines)


BOOLEANS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def config_override(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` for a SchedulerConfig field, the value parsed as the field's default is typed."""
    name, _, value = text.partition("=")
    fields = SchedulerConfig.__dataclass_fields__
    if name not in fields or not value:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with a SchedulerConfig field, got {text!r}")
    kind = type(fields[name].default)
    if kind is bool:
        if value.lower() not in BOOLEANS:
            raise argparse.ArgumentTypeError(f"{name}: expected one of {sorted(BOOLEANS)}, got {value!r}")
        return name, BOOLEANS[value.lower()]
    try:
        return name, kind(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error}") from None


def traced_shape(text: str) -> tuple[tuple[int, int], float]:
    """`--traced 512:12288:9.1`: a (query bucket, history bucket) traced shape and its last run's ms."""
    try:
        rows, history, ms = text.split(":")
        return (int(rows), int(history)), float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWS:HISTORY:MS, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {list(POLICIES)}")
    parser.add_argument("--trace", type=Path, help="recorded arrivals (JSONL); default: a synthetic trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=60.0, help="synthetic trace length")
    parser.add_argument("--rate", type=float, default=0.6, help="synthetic arrivals per second")
    parser.add_argument("--long-fraction", type=float, default=0.15)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--long-threshold", type=int, default=4096, help="prompt tokens from which TTFT is 'long'")
    parser.add_argument("--step-target-ms", type=float, default=500.0)
    parser.add_argument("--num-blocks", type=int, default=16_384)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--ms-fixed", type=float, default=CostFunction.fixed_ms)
    parser.add_argument("--ms-row", type=float, default=CostFunction.row_ms)
    parser.add_argument("--ms-pair", type=float, default=CostFunction.pair_ms)
    parser.add_argument("--ms-decode-lane", type=float, default=CostFunction.decode_lane_ms)
    parser.add_argument("--noise", type=float, default=CostFunction.noise)
    parser.add_argument("--ms-prefill-fixed", type=float, default=CostFunction.prefill_fixed_ms)
    parser.add_argument("--kv-bucket", type=int, default=0,
                        help="> 0: chunks run padded to query buckets and the scheduler plans so (CUDA's engine)")
    parser.add_argument("--row-tile", type=int, default=1, help="a step's rows run in tiles of this many")
    parser.add_argument("--eager-extra-ms", type=float, default=0.0,
                        help="with --kv-bucket: what a step of decode lanes and one chunk costs more without a trace")
    parser.add_argument("--first-run-extra-ms", type=float, default=0.0,
                        help="with --kv-bucket: what such a step costs more again on its shape's first eager run")
    parser.add_argument("--ms-prefill-host", type=float, default=0.0,
                        help="the least a step with prefill takes (its host submission, where that bounds it)")
    parser.add_argument("--ms-solo-extra", type=float, default=0.0,
                        help="what a step with prefill and no decode lanes costs more (an uncontended chunk)")
    parser.add_argument("--row-granule", type=int, default=1,
                        help="a chunk's rows cost in whole granules of this many (a GEMM's tile steps)")
    parser.add_argument("--stall-rate", type=float, default=0.0, help="fraction of steps whose host stalls")
    parser.add_argument("--stall-ms", type=float, default=0.0, help="what a stalled step adds")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", type=config_override,
                        help="a SchedulerConfig field set over every policy (repeatable): --set floor_slack=1.25")
    parser.add_argument("--warm-passes", type=int, default=0,
                        help="runs of the trace before the measured one (shapes they meet are traced after each)")
    parser.add_argument("--stand-ins", action="store_true",
                        help="with --eager-extra-ms: an untraced step replays a larger trace run within its limit")
    parser.add_argument("--stand-in-build-ms", type=float, default=0.0,
                        help="with --stand-ins: or one run within this many ms (the engine's eager-build bound)")
    parser.add_argument("--traced", action="append", default=[], metavar="ROWS:HISTORY:MS", type=traced_shape,
                        help="a shape traced beside decode lanes when the measured run starts, and its last run's "
                             "ms (repeatable; replaces what the warm runs traced)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.pop(COST_MODEL_ENV, None)  # each policy names its own cost model
    arrivals = load_trace(args.trace) if args.trace else synthetic_trace(args)
    cost = CostFunction(args.ms_fixed, args.ms_row, args.ms_pair, args.ms_decode_lane, args.noise,
                        args.ms_prefill_fixed, args.kv_bucket, args.row_tile, args.eager_extra_ms,
                        args.ms_prefill_host, args.stall_rate, args.stall_ms, args.first_run_extra_ms,
                        args.ms_solo_extra, args.row_granule)
    # with padding the engine's paged chunk kernel reads exactly the KV each row sees (pads_history False)
    base = SchedulerConfig(num_blocks=args.num_blocks, max_running=args.max_running,
                           step_target_ms=args.step_target_ms, max_model_len=1 << 20, kv_bucket=args.kv_bucket,
                           pads_history=False, row_quantum=args.row_tile)
    rows = {}
    for name in (p.strip() for p in args.policies.split(",") if p.strip()):
        if name not in POLICIES:
            print(f"error: unknown policy {name!r}; choose from {list(POLICIES)}", file=sys.stderr)
            return 2
        config = replace(base, **(POLICIES[name] | dict(args.set)))
        result = simulate(config, arrivals, cost, args.seed, args.warm_passes, args.stand_ins, dict(args.traced),
                          args.stand_in_build_ms)
        rows[name] = summarize(result, args.long_threshold)
        if args.trace and (figures := contended_figures(result, args.long_threshold)):
            long = figures.pop("long_arrival")
            solo = solo_ttft(config, long, cost, args.seed, args.warm_passes)
            rows[name]["contended"] = figures | {"long_ttft_vs_solo": figures["long_ttft_s"] / solo}
    if args.json:
        print(json.dumps({"arrivals": len(arrivals), "cost": asdict(cost), "policies": rows}, indent=1))
    else:
        print(f"{len(arrivals)} arrivals, step target {args.step_target_ms:g} ms, cost {cost}")
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
