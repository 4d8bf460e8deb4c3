"""Steps of single-row lanes and one prefill chunk (a contended step) through `mx.compile`d fused forwards.

Profiled on the H200 (8B, 8 decode lanes and a 128-row chunk over 8k tokens, `benchmarks/gpu/profile_mixed.py`):
the eager fused forward spends 4.8 ms building its graph in Python and 9.8 ms in MLX's encode, against ~10 ms of
GPU work, and that fixed cost is what keeps a contended chunk small. Compiled, a shape is traced once and replayed.
Shapes repeat because every dimension is a bucket: decode lanes as `compiled_step` pads them, the chunk's rows to a
`query_bucket` (pad rows repeat the last position and write the pool's scratch block), its history to a
`history_bucket`, and the causal mask is computed in the graph from the rows' positions.

Measured in the same call (eighth run): host submission 13.4 -> 7.6 ms, but the step stays 20.5 ms queued back to
back: such steps are bound by the GPU there. A new shape's trace costs 15-50 ms at first use, which a contended
step would pay inside a stream's gap; with `defer_traces` a shape's first steps run eager and the engine traces it
when it next has nothing to run (`trace_deferred`, on zero inputs: nothing is evaluated). A trace's first real run
still paid first-use work (H200, 0.6B: a long prompt's first 2,040-row chunk beside 8 streams 29.9 ms, 13.7-16.0
once run before; twenty-fourth run), so with `run_traces` the idle engine also runs each new trace once over the
pool's scratch block.

An eager step's host build delays the tokens of the step before it (H200, 0.6B beside 8 streams: a long prompt's
last 16 rows built for 27 ms, the window's longest gap, where a traced 768-row step of the same lanes and history
bucket ran in 14.9 ms; twenty-sixth run). With `stand_ins`, a step whose shape has no trace replays the fewest-rows
trace of the same lanes with at least its rows and history bucket, its chunk and table padded, where that trace's
last run took no longer than eager steps' builds do or than the step was planned to take (`stand_in`).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np

from mlx_serve.compiled_step import decode_tables, lane_bucket, width_bucket
from mlx_serve.fused_decode import FusedDecode
from mlx_serve.kv_pool import KVPool, slot_array
from mlx_serve.ragged import (
    ChunkAttention,
    DecodeAttention,
    DecodeRows,
    LaneRows,
    PrefillGather,
    StepLayout,
    sdpa_chunk_attention,
)
from scheduler import Lane, LaneKind
from scheduler.buckets import history_bucket, query_bucket, query_buckets
from scheduler.cost_models import PrefillChunk
from scheduler.traced_shapes import StandIn

MixedShape = tuple[int, int, int, int]  # padded (decode lanes, their table width, chunk rows, chunk history)
# `CompiledMixed.eager_build_ms` is the median of this many latest eager builds of the kind (a shape's first or a
# later one): a first build may also hold one-off NVRTC or cuDNN work (seconds), which a mean would carry for long
EAGER_BUILDS_KEPT = 9


def neighbour_shapes(shape: MixedShape, unit: int, max_rows: int) -> list[MixedShape]:
    """Shapes a workload near `shape` meets next: a query bucket either side (budgets move by halves and
    midpoints), the next history bucket (a long prompt read on), and for a chunk alone the smallest chunk at its
    history (a prompt that continues a cached prefix). Never more rows than history or `max_rows`."""
    count, width, rows, padded = shape
    smaller = query_buckets(rows)[-2:-1]  # the bucket below, if any
    later = history_bucket(padded + 1, unit)
    candidates = [(count, width, r, padded) for r in (*smaller, query_bucket(rows + 1))]
    candidates.append((count, width, rows, later))
    if count == 0 and rows > query_bucket(1):
        candidates.append((0, width, query_bucket(1), padded))
    return [c for c in candidates if c[2] <= min(c[3], max_rows)]


class TracedMixedShapes:
    """`scheduler.traced_shapes.TracedShapes` over a runner's `CompiledMixed`: a step of decode lanes and one
    prefill chunk of 2+ rows runs compiled when its shape has a trace (always, if traces are not deferred), and with
    `price_stand_ins` also where a larger trace would stand in for it (`CompiledMixed.stand_in`, bounded by eager
    builds: the step's own limit is not known while its budget is chosen).

    Why: on an H100 (forty-seventh run, 0.6B beside 8 streams at a 12.65 ms target) the first half of a 16k prompt
    was priced eager and read in 256-row chunks (12.2 ms predicted) that ran as stand-ins in ~10 ms, where 512-row
    chunks would have stood in for the same ~10 ms: TTFT 2.15x solo, against 1.34x where 1,024-row traces existed."""

    def __init__(self, mixed: CompiledMixed, kv_bucket: int, gather: PrefillGather,
                 price_stand_ins: bool = False) -> None:  # fmt: skip
        self.mixed = mixed
        self.kv_bucket = kv_bucket
        self.gather = gather
        self.price_stand_ins = price_stand_ins

    def _shape(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> MixedShape | None:
        if len(chunks) != 1 or chunks[0].rows < 2:
            return None  # two chunks, or a one-row chunk (a decode-like row), run another way
        chunk = chunks[0]
        return self.mixed.shape_of(decode, chunk.rows, chunk.history + chunk.rows, self.kv_bucket)

    def traced(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        shape = self._shape(chunks, decode)
        if shape is None:
            return False
        if self.mixed.has_trace(shape):
            return True
        return self.price_stand_ins and self.mixed.stand_ins and self.mixed.stand_in(shape) is not None

    def met(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> bool:
        shape = self._shape(chunks, decode)
        return shape is None or self.mixed.has_run(shape)  # other steps: not tracked here

    def stand_in(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float | None) -> StandIn | None:
        """Where a step of these chunks has no trace and a larger one that ran within `limit_ms` would stand in for
        it: the most rows its chunk could carry through such a trace (its rows, within its history bucket) where a
        step of those rows replays a trace that also ran within it, and that run. None: it replays its own trace,
        runs eager, or is not a step traced here. Only traces within the limit: one past it stands in by the eager
        builds' bound alone, which a step cut to fewer rows (a shape of another kind) may not meet: it would run
        eager."""
        shape = self._shape(chunks, decode)
        if shape is None or limit_ms is None or not self.mixed.stand_ins or self.mixed.has_trace(shape):
            return None
        history = chunks[0].history

        def carried(near: MixedShape) -> int:  # rows past the trace's, or past its history bucket, would not fit it
            return min(near[2], near[3] - history)

        within = [near for near in self.mixed.stand_ins_for(shape, limit_ms) if self.mixed.last_run_ms(near) <= limit_ms]
        for near in sorted(within, key=lambda near: (-carried(near), near[3])):
            rows = carried(near)
            grown = self.mixed.shape_of(decode, rows, history + rows, self.kv_bucket)
            # as the runner will choose for the grown step (`CompiledMixed.ready`): its own trace may be a slower one
            replayed = grown if self.mixed.has_trace(grown) else self.mixed.stand_in(grown, limit_ms)
            ms = None if replayed is None else self.mixed.last_run_ms(replayed)
            if ms is not None and ms <= limit_ms:
                return StandIn(rows, ms)
        return None

    def stand_in_run_ms(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane], limit_ms: float) -> float | None:
        """The last run of the trace the runner would replay for a step of these chunks in place of its own, as it
        chooses (`CompiledMixed.ready`: bounded by eager builds or `limit_ms`); None: it has its own trace, runs
        eager, or is not a step traced here."""
        shape = self._shape(chunks, decode)
        if shape is None or not self.mixed.stand_ins or self.mixed.has_trace(shape):
            return None
        near = self.mixed.stand_in(shape, limit_ms)
        return None if near is None else self.mixed.last_run_ms(near)

    def want(self, chunks: Sequence[PrefillChunk], decode: Sequence[Lane]) -> None:
        shape = self._shape(chunks, decode)
        if shape is not None:
            self.mixed.want(shape, self.gather, self.kv_bucket)


def scratch_tokens(count: int, vocab_size: int) -> mx.array:
    """`count` token ids for a scratch run, distinct while the vocabulary lasts: on one repeated token every row is
    the same, so an MoE model routes them all to the same top-k experts and a timed run reads a fraction of the
    expert weights a real step of its shape reads (30B-A3B: 8 of 128 experts a layer)."""
    return mx.array(np.arange(count, dtype=np.int32) % vocab_size)


def compilable(lanes: Sequence[Lane]) -> bool:
    """Steps it runs: single-row lanes and exactly one prefill chunk (two chunks in one step stay eager)."""
    return sum(1 for lane in lanes if lane.rows > 1) == 1


class CompiledMixed:
    """Returns the logits of `[decode lanes..., the chunk's last row]` of a `compilable` step."""

    def __init__(
        self,
        pool: KVPool,
        fused: FusedDecode,
        attention: DecodeAttention,
        logits: Callable[[mx.array], mx.array],
        min_lanes: int = 1,
        chunk_attention: ChunkAttention = sdpa_chunk_attention,
        defer_traces: bool = False,
        neighbour_traces: int = 0,
        run_traces: bool = False,
        stand_ins: bool = False,
        time_traces: bool = False,
    ) -> None:
        self.pool = pool
        self.chunk_attention = chunk_attention
        self.fused = fused
        self.attention = attention
        self.logits = logits
        self.min_lanes = min_lanes  # 2+ decode lanes are padded to at least this many (see ModelRunner)
        # one compiled function per (with decode lanes, history gather): a step of a chunk alone has no decode
        # attention to trace, and a trace keeps the functions it was traced with
        self._steps: dict[tuple[bool, PrefillGather], Callable] = {}
        self.shapes: set[MixedShape] = set()  # traced
        self.defer_traces = defer_traces  # a new shape runs eager until `trace_deferred` traces it
        self._deferred: dict[MixedShape, tuple[PrefillGather, int]] = {}  # met, untraced (gather, history unit)
        self._untraceable: set[MixedShape] = set()  # their trace failed: they stay eager
        # with deferred traces: how many shapes next to met ones (`neighbour_shapes`) may be traced ahead of use
        self.neighbour_traces = neighbour_traces
        self._neighbours: dict[MixedShape, tuple[PrefillGather, int]] = {}  # traced after every met shape
        self._most_rows = 0  # the largest query bucket met: neighbours never grow past it
        self._ran: set[MixedShape] = set()  # shapes run at least once (on real inputs, or on scratch ones when idle)
        self.run_traces = run_traces  # `trace_deferred` also runs each shape once over the scratch block
        # with `run_traces`: then once more, timed, as the trace's run until its first ordinary one (`stand_in` takes
        # only traces with a run: without this, one made while idle waits for a real step of its own shape)
        self.time_traces = time_traces
        # whether the last call was its shape's first run: a trace made on zero inputs evaluates nothing, so the
        # first real step of a shape may pay one-off work (its time does not train the scheduler)
        self.first_run = False
        self.stand_ins = stand_ins  # with deferred traces: an untraced step may replay a larger trace (`stand_in`)
        # host ms of eager steps of compilable shapes, by whether the step was its shape's first eager one (H200,
        # 0.6B beside 8 streams: 20-33 ms first, ~15 ms later; twenty-seventh run)
        self._eager_builds = {first: deque(maxlen=EAGER_BUILDS_KEPT) for first in (True, False)}
        # their medians, kept until the next build: the planner asks for every candidate budget of every step
        self._build_medians: dict[bool, float | None] = {}
        self._ran_eager: set[MixedShape] = set()
        # each traced shape's last ordinary run or replay as a stand-in (device ms), or until it has one its timed
        # scratch run (`time_traces`)
        self._measured_ms: dict[MixedShape, float] = {}
        self.stand_ins_run = 0
        self.stood_in = False

    @property
    def deferred(self) -> int:
        """Shapes met and waiting for `trace_deferred`."""
        return len(self._deferred)

    @property
    def speculative(self) -> int:
        """Shapes next to met ones waiting for `trace_deferred` (within what `neighbour_traces` has left)."""
        return min(len(self._neighbours), self.neighbour_traces)

    def shape(self, decode: Sequence[Lane], chunk: Lane, kv_bucket: int) -> MixedShape:
        return self.shape_of(decode, chunk.rows, chunk.end, kv_bucket)

    def shape_of(self, decode: Sequence[Lane], rows: int, end: int, kv_bucket: int) -> MixedShape:
        """The padded shape of a step of `decode` lanes and a chunk of `rows` rows ending at position `end`."""
        n, size = len(decode), self.pool.block_size
        count = max(lane_bucket(n), self.min_lanes) if n > 1 else n
        width = width_bucket(max(-(-lane.end // size) for lane in decode)) if decode else 1
        return count, width, query_bucket(rows), history_bucket(end, kv_bucket)

    def has_trace(self, shape: MixedShape) -> bool:
        """Whether a step of `shape` replays a trace now (`ready` without recording the shape as met)."""
        return not self.defer_traces or shape in self.shapes

    def has_run(self, shape: MixedShape) -> bool:
        """Whether a step of `shape` would replay a trace that has run (on real inputs, or on scratch ones when idle)
        or, without a trace, run eager on a shape run eager before: a shape's first run in either form pays one-off
        work (a trace made on zero inputs evaluated nothing; an eager shape's first builds its kernels)."""
        return shape in self._ran if self.has_trace(shape) else shape in self._ran_eager

    def want(self, shape: MixedShape, gather: PrefillGather, kv_bucket: int) -> None:
        """Queue `shape` for `trace_deferred` as if a step had met it (the scheduler wanted a budget of it)."""
        if shape not in self.shapes and shape not in self._untraceable:
            self._most_rows = max(self._most_rows, shape[2])
            self._deferred.setdefault(shape, (gather, kv_bucket))
            self._neighbours.pop(shape, None)

    def ready(
        self, decode: Sequence[Lane], chunk: Lane, kv_bucket: int, gather: PrefillGather, limit_ms: float | None = None
    ) -> MixedShape | None:
        """The shape the step replays now: its own, always unless traces are deferred and it has none yet (then it
        waits for `trace_deferred`), else a `stand_in` (`limit_ms`: what the step was planned to take at most);
        None: the step runs eager."""
        shape = self.shape(decode, chunk, kv_bucket)
        if not self.defer_traces:
            return shape
        self._most_rows = max(self._most_rows, shape[2])
        if shape in self.shapes:
            return shape
        self.want(shape, gather, kv_bucket)
        return self.stand_in(shape, limit_ms) if self.stand_ins else None

    def stand_in(self, shape: MixedShape, limit_ms: float | None = None) -> MixedShape | None:
        """The traced shape of the same lanes and table width with at least `shape`'s rows and history bucket, more
        of either, whose last ordinary run took no longer than an eager step of `shape` takes to build
        (`eager_build_ms`: the eager step's build would hold the previous step's tokens at least that long) or than
        `limit_ms` (what the step was planned to take: such a trace is a step the planner accepts); the fewest rows,
        then the nearest history bucket. None where there is none, or neither bound is known."""
        return min(self.stand_ins_for(shape, limit_ms), key=lambda near: (near[2], near[3]), default=None)

    def stand_ins_for(self, shape: MixedShape, limit_ms: float | None = None) -> list[MixedShape]:
        """Every traced shape `stand_in` may choose for `shape` (its bounds: eager builds, `limit_ms`)."""
        bounds = [ms for ms in (self.eager_build_ms(shape), limit_ms) if ms is not None]
        if not bounds:
            return []
        count, width, rows, padded = shape
        return [
            near for near, ms in self._measured_ms.items()
            if near[:2] == (count, width) and near[2] >= rows and near[3] >= padded and near != shape
            and ms <= max(bounds)
        ]  # fmt: skip

    def last_run_ms(self, shape: MixedShape) -> float | None:
        """The device ms of a traced shape's last ordinary run, else its timed scratch run's (None: neither yet)."""
        return self._measured_ms.get(shape)

    def record_eager_build(self, shape: MixedShape, ms: float) -> None:
        """An eager step of compilable `shape` took `ms` of host time to build and submit."""
        first = shape not in self._ran_eager
        self._eager_builds[first].append(ms)
        self._build_medians.pop(first, None)
        self._ran_eager.add(shape)

    def eager_build_ms(self, shape: MixedShape) -> float | None:
        """The median host time of the latest eager builds like a step of `shape` would be (its shape's first, or
        a later one; the other kind where none is timed yet); None before the first."""
        first = shape not in self._ran_eager
        own = self._build_median(first)
        return own if own is not None else self._build_median(not first)

    def _build_median(self, first: bool) -> float | None:
        """The median of the latest eager builds of one kind (a shape's first, or later); None: none timed."""
        if first not in self._build_medians:
            builds = self._eager_builds[first]
            self._build_medians[first] = float(np.median(builds)) if builds else None
        return self._build_medians[first]

    def summary(self) -> dict:
        """For a report: shapes traced and waiting, stand-ins run, each traced shape's last ordinary run `[decode
        lanes, table width, rows, history bucket, ms]`, and the median eager build of each kind (ms; None: none)."""
        runs = sorted(self._measured_ms.items())
        builds = {"first": self._build_median(True), "later": self._build_median(False)}
        return {"traced": len(self.shapes), "waiting": self.deferred, "stand_ins": self.stand_ins_run,
                "runs_ms": [[*shape, round(ms, 2)] for shape, ms in runs], "eager_build_ms": builds}  # fmt: skip

    def untrace(self, shapes: Iterable[MixedShape]) -> None:
        """Forget these shapes' traces and runs: their steps run eager or stand in again until `trace_deferred`
        traces them anew (`run_gpu_bench --keep-traces-at` makes a warm engine's sparse trace set this way)."""
        for shape in list(shapes):
            self.shapes.discard(shape)
            self._ran.discard(shape)
            self._measured_ms.pop(shape, None)

    def record_run(self, shape: MixedShape, ms: float) -> None:
        """A compiled step replaying `shape`, not its first run (its own step, or a stand-in: the same trace over the
        same padded rows and history), took `ms` on the device."""
        self._measured_ms[shape] = ms

    def trace_deferred(self, run: bool = True) -> bool:
        """Trace the first shape `ready` turned away, else (within `neighbour_traces`) one next to a met shape, on
        zero inputs of its shapes (the outputs are dropped unevaluated), then, with `run_traces` and `run`, run it
        once over the scratch block (`_run_on_scratch`). Returns whether there was one."""
        if self._deferred:
            shape = next(iter(self._deferred))
            gather, unit = self._deferred.pop(shape)
            if self.neighbour_traces:
                for near in neighbour_shapes(shape, unit, self._most_rows):
                    if near not in self.shapes and near not in self._untraceable and near not in self._deferred:
                        self._neighbours.setdefault(near, (gather, unit))
        elif self._neighbours and self.neighbour_traces:
            shape = next(iter(self._neighbours))
            gather, unit = self._neighbours.pop(shape)
            self.neighbour_traces -= 1
        else:
            return False
        self._trace(shape, gather)
        if self.run_traces and run:
            self._run_on_scratch(shape, gather, unit)
        return True

    def _run_on_scratch(self, shape: MixedShape, gather: PrefillGather, unit: int) -> None:
        """Run a traced shape once on the device with every lane over the pool's scratch block (written by pad rows
        only, read by no request), so that its first real step pays no first-run work."""
        count, width, rows, padded = shape
        size, scratch = self.pool.block_size, self.pool.scratch_block
        end = (width - 1) * size + 1  # a decode lane whose table needs `width` blocks
        decode = [Lane("scratch", LaneKind.DECODE, (0,), end - 1, (scratch,) * width, True) for _ in range(count)]
        real = min(rows, padded)  # a chunk's rows pad up to their query bucket, which may pass its history bucket
        chunk = Lane("scratch", LaneKind.PREFILL, (0,) * real, padded - real, (scratch,) * (padded // size), True)
        if self.shape(decode, chunk, unit) != shape:
            return  # not expected (these lanes make every traced shape); if so, its first real step pays
        tokens = scratch_tokens(count + real, self.fused.vocab_size)
        mx.eval(self(decode, chunk, tokens, unit, gather), self.pool.state())
        if self.time_traces:  # the first run paid first-use work; this one's host wall time bounds its device time
            t0 = time.perf_counter()
            mx.eval(self(decode, chunk, tokens, unit, gather), self.pool.state())
            self._measured_ms.setdefault(shape, (time.perf_counter() - t0) * 1e3)

    def _trace(self, shape: MixedShape, gather: PrefillGather) -> None:
        count, width, rows, padded = shape
        lanes = max(count, 1)  # a chunk alone still passes one pad lane's table
        i32 = mx.int32
        try:
            self._step(count > 0, gather)(
                mx.zeros((count + rows,), i32), mx.zeros((count + rows,), i32), mx.zeros((count + rows,), i32),
                mx.zeros((lanes, width), i32), mx.zeros((lanes,), i32), mx.zeros((padded // self.pool.block_size,), i32),
                mx.zeros((2,), i32), mx.zeros((count + 1,), i32), self.pool.keys, self.pool.values,
            )  # fmt: skip
        except Exception:
            self._untraceable.add(shape)
            raise
        self.shapes.add(shape)

    def _step(self, with_decode: bool, gather: PrefillGather) -> Callable:
        key = (with_decode, gather)
        if key not in self._steps:
            self._steps[key] = mx.compile(functools.partial(self._traced, *key))
        return self._steps[key]

    def __call__(
        self,
        decode: Sequence[Lane],
        chunk: Lane,
        tokens: mx.array,
        kv_bucket: int,
        gather: PrefillGather,
        shape: MixedShape | None = None,
    ) -> mx.array:
        """`tokens` `[len(decode) + chunk.rows]`: the decode lanes' inputs, then the chunk's, whose history is
        padded to a `history_bucket` of `kv_bucket` and read through `gather`. `shape`: the trace to replay (a
        `stand_in` with more rows or a longer history bucket; default: the step's own)."""
        size, scratch = self.pool.block_size, self.pool.scratch_block
        n = len(decode)
        own = self.shape(decode, chunk, kv_bucket)
        shape = own if shape is None else shape
        count, _, rows, padded = shape
        if shape[:2] != own[:2] or shape[3] < own[3] or rows < own[2]:
            raise ValueError(f"a step of shape {own} cannot replay {shape}")
        self.stood_in = shape != own  # whether the last call replayed a stand-in
        self.stand_ins_run += self.stood_in
        # a step without decode lanes still passes a (one pad lane) table: the traced function leaves it unread
        meta = decode_tables(decode, max(count, 1), self.pool)
        pad = rows - chunk.rows
        # pad rows repeat the last position (finite attention, dropped) and write scratch slots no lane reads
        chunk_positions = np.minimum(np.arange(chunk.start, chunk.start + rows), chunk.end - 1).astype(np.int32)
        chunk_slots = np.concatenate([
            slot_array(chunk.block_ids, chunk.start, chunk.end, size),
            scratch * size + np.arange(pad, dtype=np.int32) % size,
        ])  # fmt: skip
        used = -(-chunk.end // size)
        table = np.full(padded // size, scratch, dtype=np.int32)
        table[:used] = chunk.block_ids[:used]

        parts = [tokens[:n]]
        if count > n:
            parts.append(mx.zeros((count - n,), dtype=tokens.dtype))
        parts.append(tokens[n:])
        if pad:
            parts.append(mx.zeros((pad,), dtype=tokens.dtype))
        inputs = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        sample_rows = np.append(np.arange(count), count + chunk.rows - 1).astype(np.int32)
        if shape == own:  # a stand-in leaves the step's own shape waiting for its trace
            self.shapes.add(shape)
            self._deferred.pop(shape, None)
            self._neighbours.pop(shape, None)
        self.first_run = shape not in self._ran
        self._ran.add(shape)
        logits, keys, values = self._step(count > 0, gather)(
            inputs,
            mx.array(np.concatenate([meta.positions[:count], chunk_positions])),
            mx.array(np.concatenate([meta.slots[:count], chunk_slots]).astype(np.int32)),
            mx.array(meta.tables), mx.array(meta.lengths), mx.array(table), mx.array([chunk.end, padded], dtype=mx.int32),
            mx.array(sample_rows), self.pool.keys, self.pool.values,
        )  # fmt: skip
        self.pool.keys[:], self.pool.values[:] = keys, values
        return mx.concatenate([logits[:n], logits[-1:]]) if count > n else logits

    def writes_in_place(self, gather: PrefillGather) -> bool:
        """Whether the traces read through `gather` write K/V in place (see `FusedDecode.mixed`; the chunk always
        reads through a block table), not through MLX's scatter."""
        return self.fused.mixed_writes_in_place(gather, ())

    def _traced(
        self,
        with_decode: bool,
        gather: PrefillGather,
        tokens: mx.array,
        positions: mx.array,
        slots: mx.array,
        tables: mx.array,
        lengths: mx.array,
        table: mx.array,
        length: mx.array,
        sample_rows: mx.array,
        keys: list[mx.array],
        values: list[mx.array],
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        pool = self.pool.view(keys, values)
        count = tables.shape[0] if with_decode else 0
        rows, padded = tokens.shape[0] - count, table.shape[0] * pool.block_size
        dtype = pool.layout.dtype
        key_positions = mx.arange(padded, dtype=mx.int32)[None, :]
        visible = key_positions <= positions[count:, None]
        mask = mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))[None, None]
        chunk = LaneRows(count, rows, mx.zeros((0,), dtype=mx.int32), mask, table, length, padded, rows, positions[count:])
        decode = DecodeRows(count, tables, lengths, pool.block_size, lanes=()) if with_decode else None
        layout = StepLayout(positions, slots, decode, (chunk,), self.attention, gather, self.chunk_attention)
        hidden = self.fused.mixed(tokens, layout, pool)
        return self.logits(hidden[sample_rows]), pool.keys, pool.values
