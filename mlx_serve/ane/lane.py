"""The prefill lane contract the runner calls, and the labelled MLX CPU stand-in.

How the runner uses a lane (one engine thread; only `CoreMLLane`'s predict runs on a worker thread):

    lane = make_lane("cpu" | "coreml", model, package=..., clock=sink.now)   # at load; "off" -> None
    # a plan lane with path == Path.ANE (a PREFILL chunk of one request), if lane.accepts(start, rows):
    pending = handoff.submit_from_pool(lane, plan_lane, pool)   # gathers [0, start) K/V, embeds, submits
    ... run the step's GPU lanes (decode keeps going) ...
    result = pending.result(timeout_s)     # raises LaneError (failure or timeout): rerun the chunk on the GPU
    handoff.write_back(result, plan_lane, pool)                 # new K/V into the pool at [start, end)
    if plan_lane.samples:
        logits = lane.logits(result.hidden[-1:])                # [1, vocab]: the LM head stays in MLX
    if sink.enabled: sink.emit(result.span(plan.step_id))       # Span "ane_chunk": lane label, rows, request

K/V layout in and out is mlx-lm's (and `KVPool.gather`'s): `[1, num_kv_heads, positions, head_dim]`, keys
after k_norm and RoPE. `hidden` is `[rows, hidden_size]` AFTER the model's final norm (fp16 from Core ML,
the model's dtype from the stand-in): pass it to `lane.logits`, which casts. `kv_in` may be empty when
start == 0. A lane never touches the KV pool or the scheduler: the runner owns both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_serve.ane import host
from mlx_serve.errors import MlxServeError
from tracing.events import Span

LANE_MODES = ("off", "cpu", "coreml")
Clock = Callable[[], float]


class LaneError(MlxServeError):
    """The lane failed or timed out on a chunk: the runner reruns that chunk on the GPU path."""


@dataclass(frozen=True, slots=True)
class LayerKV:
    keys: mx.array  # [1, num_kv_heads, positions, head_dim]
    values: mx.array


@dataclass(frozen=True, slots=True)
class ChunkResult:
    request_id: str
    start: int  # position of the chunk's first row
    hidden: mx.array  # [rows, hidden_size], after the final norm
    kv: tuple[LayerKV, ...]  # the chunk's new K/V per layer, [1, KVH, rows, D]
    label: str  # which lane computed it: "coreml-ane" or "mlx-cpu-standin"
    submitted_s: float  # the lane's clock (the trace sink's, when given) at submit and when ready
    finished_s: float

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])

    def span(self, step_id: int | None = None) -> Span:
        """The trace span of this chunk: host submit-to-ready, not exact hardware time."""
        attrs = {"request_id": self.request_id, "rows": self.rows, "start": self.start, "lane": self.label}
        return Span("ane_chunk", self.submitted_s, self.finished_s, step_id=step_id, attrs=attrs)


class PendingChunk(Protocol):
    def done(self) -> bool:
        """True once the result is ready (the stand-in cannot tell: False until `result`)."""
        ...

    def result(self, timeout_s: float | None = None) -> ChunkResult:
        """Wait for the chunk; LaneError on failure or timeout (the stand-in evaluates and ignores timeout)."""
        ...


class PrefillLane(Protocol):
    label: str  # shown in traces; the stand-in says so
    max_context: int  # a chunk may start at most here (past KV it can attend to)

    def accepts(self, start: int, rows: int) -> bool: ...
    def submit(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> PendingChunk: ...
    def run_chunk(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> ChunkResult: ...
    def logits(self, hidden: mx.array) -> mx.array: ...
    def close(self) -> None: ...


class _EvaluatingChunk:
    """A stand-in chunk queued with `mx.async_eval` on the CPU stream; `result` waits for it."""

    def __init__(self, result: ChunkResult, clock: Clock) -> None:
        self._result = result
        self._clock = clock
        mx.async_eval(result.hidden, *[a for kv in result.kv for a in (kv.keys, kv.values)])

    def done(self) -> bool:
        return False  # MLX exposes no completion query; callers use result()

    def result(self, timeout_s: float | None = None) -> ChunkResult:
        mx.eval(self._result.hidden, *[a for kv in self._result.kv for a in (kv.keys, kv.values)])
        finished = self._clock()
        return dataclasses.replace(self._result, finished_s=finished)


class MlxCpuStandInLane:
    """A STAND-IN for the Neural Engine: the same submodel (decoder layers + final norm, KV in and out, the
    embedding and LM head outside) run by mlx-lm's own layers on MLX's CPU stream.

    It proves splitting, hand-off, KV write-back, tracing and cost cells end to end where Core ML cannot
    run. It is labelled `mlx-cpu-standin` everywhere so no measurement is ever mistaken for the ANE's.
    Computed in the model's dtype, so its tokens equal the GPU path's up to kernel rounding.
    """

    label = "mlx-cpu-standin"

    def __init__(self, model, max_context: int = 1 << 30, clock: Clock = time.perf_counter) -> None:
        self.model = model
        self.max_context = max_context
        self.clock = clock

    def accepts(self, start: int, rows: int) -> bool:
        return rows > 0 and start <= self.max_context

    def submit(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> _EvaluatingChunk:
        from mlx_lm.models.cache import KVCache

        submitted = self.clock()
        with mx.stream(mx.cpu):
            caches = [KVCache() for _ in self.model.layers]
            if start:
                for cache, kv in zip(caches, kv_in):
                    cache.state = (kv.keys, kv.values, start)
            hidden = self.model.model(mx.array([list(token_ids)]), cache=caches)[0]
            end = start + len(token_ids)
            kv = tuple(
                LayerKV(cache.keys[..., start:end, :], cache.values[..., start:end, :]) for cache in caches
            )
        result = ChunkResult(request_id, start, hidden, kv, self.label, submitted, submitted)
        return _EvaluatingChunk(result, self.clock)

    def run_chunk(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> ChunkResult:
        return self.submit(request_id, token_ids, start, kv_in).result()

    def logits(self, hidden: mx.array) -> mx.array:
        return host.lm_head(self.model, hidden)

    def close(self) -> None:
        pass


def make_lane(mode: str, model, package=None, clock: Clock = time.perf_counter) -> PrefillLane | None:
    """`off` -> None; `cpu` -> the labelled MLX stand-in; `coreml` -> the Core ML lane (macOS, a package)."""
    if mode == "off":
        return None
    if mode == "cpu":
        return MlxCpuStandInLane(model, clock=clock)
    if mode == "coreml":
        from mlx_serve.ane.coreml_lane import CoreMLLane

        return CoreMLLane(model, package, clock=clock)
    raise ValueError(f"ane lane must be one of {LANE_MODES}, not {mode!r}")
