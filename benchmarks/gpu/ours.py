"""mlx_serve's engine on the same in-memory model, measured the way `peer.py` measures mlx-lm."""

from __future__ import annotations

import bisect
import math
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from benchmarks.gpu import api_trace, gc_pauses
from benchmarks.gpu.api_calls import ApiCall, ApiCalls
from benchmarks.gpu.host_samples import StackSampler, runs, time_in
from benchmarks.gpu.host_waits import HostWaits, overlap_ms
from benchmarks.gpu.models import DummyModel
from benchmarks.gpu.workloads import WARM_STEPS, BenchParams, Prompts, gap_summary, steady_rate
from mlx_serve.compiled_step import lane_bucket
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.memory_limits import mlx_memory_limit
from mlx_serve.types import GenerationRequest
from scheduler.step_target import decode_only_ms
from tracing.events import Span, StepExecuted, StepPlanned, TokenCommitted
from tracing.sink import MemorySink

HOST_PHASES = ("planning", "preparation", "submission", "consumption", "application")


class Recorder:
    """The engine observer: first-token times, inter-token gaps and decode-only steps as the engine publishes them.

    The measuring thread sleeps until what it waits for has happened: the engine thread checks the wait's predicate
    as it records and wakes it once, where it used to be woken on every token (8-64 a step) or poll the whole trace
    every 10 ms, work beside our engine thread that mlx-lm's side, run in one loop, does not have. (Its cost was not
    measurable: H100, 0.6B at 64 streams, 12,952-13,115 tok/s polled against 13,059-13,176; fifty-third run.)"""

    def __init__(self) -> None:
        self.first: list[float] = []  # ttft_s of each request, in order
        self.gaps: list[float] = []
        self.steps = 0  # every step accounted
        self._decode_only: Counter[int] = Counter()  # steps with no prefill rows, by decode lanes
        self._cond = threading.Condition()
        self._wanted: Callable[[], bool] | None = None  # the waiting thread's predicate

    def on_step(
        self, elapsed_ms: float, rows: int, prefill_rows: int, decode_lanes: int, budget_halvings: int
    ) -> None:
        with self._cond:
            self.steps += 1
            if not prefill_rows:
                self._decode_only[decode_lanes] += 1
            self._wake()

    def on_first_token(self, ttft_s: float) -> None:
        with self._cond:
            self.first.append(ttft_s)
            self._wake()

    def on_token_gap(self, gap_s: float) -> None:
        with self._cond:
            self.gaps.append(gap_s)
            self._wake()

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        pass

    def decode_only_steps(self, lanes: int) -> int:
        """Steps so far of exactly `lanes` decode lanes and no prefill rows."""
        return self._decode_only[lanes]

    def _wake(self) -> None:
        if self._wanted is not None and self._wanted():
            self._wanted = None  # once: what it waits for only grows
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Sleep until `predicate` holds (checked on the engine thread as it records); False at the timeout."""
        with self._cond:
            self._wanted = predicate
            try:
                return self._cond.wait_for(predicate, timeout_s)
            finally:
                self._wanted = None

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:
        if not self.wait_for(predicate, timeout_s):
            raise TimeoutError("the engine stopped producing tokens")

    def reset(self) -> None:
        with self._cond:
            self.first.clear()
            self.gaps.clear()
            self._decode_only.clear()


class OurSide:
    def __init__(
        self, dummy: DummyModel, kv_blocks: int, step_target_ms: float, attention: str, **engine: Any
    ) -> None:
        """`engine`: further EngineConfig fields (compile_decode, cost_model, ...)."""
        self.recorder = Recorder()
        self.sink = MemorySink()
        config = EngineConfig(
            model=dummy.name,
            kv_blocks=kv_blocks,
            max_running=64,
            step_target_ms=step_target_ms,
            decode_attention=attention,
            trace=self.sink,
            observer=self.recorder,
            **engine,
        )
        self.engine = Engine.from_model(dummy.model, dummy.tokenizer, dummy.config, config)
        self.cost_observations: list[list] = []
        self._record_cost_observations()
        self.decode_observations: list[list] = []
        self._record_decode_observations()
        self.host_waits = HostWaits.load()  # None: the bench runs without the host_waits.c shim preloaded
        # API_CALLS=1: every CUDA call of the contended pass at least API_CALLS_MIN_US long (default 50), timed
        # through CUPTI (`api_calls.c`): the longest gap's `api_calls` and the submissions' `submission_api_calls`
        self.api_calls = _api_calls() if os.environ.get("API_CALLS") == "1" else None
        self.api_calls_result = 0  # CUPTI's answer to the last subscription (0: timing)
        # HOST_SAMPLES=1: the engine thread's Python stack sampled through the contended pass (`host_samples`)
        self.samples: list = []
        self.gc_pauses: list[gc_pauses.GcPause] = []  # the last contended pass's collections
        self.pass_started = 0.0  # perf_counter() at the last contended pass's start

    def _record_cost_observations(self) -> None:
        """Every step the cost model is shown, as it is shown (the engine thread appends): [[[rows, history] per
        chunk], decode lanes, path, auxiliary, compiled, ms]. A replay of these is the live fit, warm passes and
        all (`replay_cost_model`); the per-pass `prefill_steps` hold only the last warm pass and one history a step."""
        model = self.engine.scheduler.cost_model
        observe = model.observe

        def recorded(shape, elapsed_ms: float) -> None:
            if math.isfinite(elapsed_ms):  # a step left in flight is first updated with no time (NaN): ignored
                self.cost_observations.append([[[c.rows, c.history] for c in shape.chunks], shape.decode_lanes,
                                               shape.path.value, shape.auxiliary, shape.compiled, round(elapsed_ms, 3)])  # fmt: skip
            observe(shape, elapsed_ms)

        model.observe = recorded

    def _record_decode_observations(self) -> None:
        """Every decode-only step the step target is shown: [entries in `cost_observations` before it, decode lanes,
        compiled, ms]. The cost model never sees them; a replay may ask what they would teach it about the fixed and
        decode-lane costs, which prefill steps of always 8 lanes cannot tell apart (sixty-second run, 8B 4-bit)."""
        step_target = self.engine.scheduler.step_target
        observe = step_target.observe

        def recorded(plan, outcome) -> None:
            elapsed = decode_only_ms(plan, outcome)
            if elapsed is not None:
                self.decode_observations.append([len(self.cost_observations), len(plan.lanes), outcome.compiled,
                                                 round(elapsed, 3)])  # fmt: skip
            observe(plan, outcome)

        step_target.observe = recorded

    def close(self) -> None:
        self.engine.shutdown()

    def settle_traces(self, timeout_s: float = 30.0) -> dict | None:
        """Let the idle engine trace the compiled shapes the last runs met (as a server between bursts does):
        {"traced": shapes traced, "waiting": still untraced at the timeout, "s": seconds waited}; None: not compiled."""
        mixed = self.engine.runner.compiled_mixed
        if mixed is None:
            return None
        t0 = time.perf_counter()
        while (mixed.deferred or mixed.speculative) and time.perf_counter() - t0 < timeout_s:
            time.sleep(0.01)
        return {"traced": len(mixed.shapes), "waiting": mixed.deferred, "neighbours_waiting": mixed.speculative,
                "s": round(time.perf_counter() - t0, 2)}

    def keep_traces_at(self, streams: int, histories: list[int]) -> int:
        """Forget the compiled traces of `streams` decode lanes and a chunk but those at these history buckets (a
        sparse set like the one some runs meet by chance, made on demand); called while the engine is idle, after
        `settle_traces`. Returns how many were forgotten."""
        mixed = self.engine.runner.compiled_mixed
        if mixed is None:
            return 0
        lanes = max(lane_bucket(streams), mixed.min_lanes)
        dropped = [shape for shape in mixed.shapes if shape[0] == lanes and shape[3] not in histories]
        mixed.untrace(dropped)
        return len(dropped)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        requests = [
            GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens, ignore_eos=True) for p in prompts
        ]
        results = self.engine.generate(requests)
        failed = [r.request_id for r in results if r.finish_reason == "error"]
        if failed:  # the engine logged why; say so here rather than fail later on a missing first token
            raise RuntimeError(f"{len(failed)} of {len(results)} requests failed in the engine (its log says why)")
        return results

    def decode(self, prompts: Prompts, p: BenchParams, streams: int) -> dict:
        """All streams decoding together for `decode_tokens` steps (after the warm-up steps). Streams get room for
        many more tokens and are cancelled once the window is measured: while later prompts are still being
        prefilled the early streams already decode, and must not finish before the last one starts."""
        self.sink.events.clear()
        room = self.engine.pool.num_blocks * self.engine.pool.block_size // streams - p.decode_prompt - 16
        budget = max(p.decode_tokens + 8, min(room, p.decode_tokens + 4096))
        handles = [
            self.engine.submit(GenerationRequest(prompt_ids=tuple(q), max_tokens=budget, ignore_eos=True))
            for q in prompts.many(streams, p.decode_prompt)
        ]
        rec = self.recorder
        wanted = rec.decode_only_steps(streams) + p.decode_tokens + WARM_STEPS + 1
        seen = rec.steps
        while not rec.wait_for(lambda: rec.decode_only_steps(streams) >= wanted, 30.0):
            if rec.steps == seen:  # no step for 30 s: every stream has finished
                break
            seen = rec.steps
        for handle in handles:
            handle.cancel()
        for handle in handles:
            list(handle)
        steps = [e for e in self.sink.events if isinstance(e, StepExecuted) and e.prefill_rows == 0]
        result = steady_rate([e.t for e in steps], [e.decode_lanes for e in steps], streams)
        full = [e for e in steps if e.decode_lanes == streams]
        measured = sorted(e.measured_ms for e in full)
        spread = (
            {"p10": measured[len(measured) // 10], "p90": measured[9 * len(measured) // 10]}
            if measured
            else {}
        )
        return {**result, "runner_ms": spread, "host_ms": self._phases({e.step_id for e in full})}

    def _phases(self, step_ids: set[int]) -> dict:
        """Median ms per step of each engine phase over these steps (consumption is mostly waiting on the GPU)."""
        per: dict[str, list[float]] = {name: [] for name in HOST_PHASES}
        for e in self.sink.events:
            if isinstance(e, Span) and e.step_id in step_ids and e.name in per:
                per[e.name].append(1e3 * (e.end - e.start))
        return {name: statistics.median(v) for name, v in per.items() if v}

    def prefill(self, prompts: Prompts, length: int) -> dict:
        """TTFT of one prompt alone; the second of two runs, as for mlx-lm."""
        self.recorder.reset()
        self._run([prompts.one(length)], 1)
        self._run([prompts.one(length)], 1)
        ttft = self.recorder.first[-1]
        return {"ttft_s": ttft, "tok_s": length / ttft}

    def contended(self, prompts: Prompts, p: BenchParams) -> dict:
        rec, n = self.recorder, p.contended_streams
        rec.reset()
        self.sink.events.clear()
        if self.host_waits is not None:
            self.host_waits.clear()
        if self.api_calls is not None:
            self.api_calls.clear()
            self.api_calls_result = self.api_calls.start(float(os.environ.get("API_CALLS_MIN_US", "50")))
        sampler = StackSampler(self.engine._thread.ident).start() if os.environ.get("HOST_SAMPLES") == "1" else None
        collections = gc_pauses.GcPauses().start()
        self.pass_started = time.perf_counter()
        mx.reset_peak_memory()
        active_before, cache_before = mx.get_active_memory(), mx.get_cache_memory()
        first_observation = len(self.cost_observations)
        capacity = self.engine.pool.num_blocks * self.engine.pool.block_size // (n + 2)
        budget = (
            min(2048, self.engine.context_length, capacity) - p.contended_prompt
        )  # plenty: streams are cancelled
        streams = [
            self.engine.submit(GenerationRequest(prompt_ids=tuple(q), max_tokens=budget, ignore_eos=True))
            for q in prompts.many(n, p.contended_prompt)
        ]
        rec.wait_until(lambda: len(rec.gaps) >= n * (p.tokens_before - 1))
        before = len(rec.gaps)
        long = self.engine.submit(
            GenerationRequest(prompt_ids=tuple(prompts.one(p.contended_long)), max_tokens=1)
        )
        rec.wait_until(lambda: len(rec.first) > n)
        after = len(rec.gaps)
        rec.wait_until(lambda: len(rec.gaps) >= after + n * p.tokens_after)
        for handle in streams:
            handle.cancel()
        for handle in [long, *streams]:
            list(handle)
        if sampler is not None:
            self.samples = sampler.stop()
        if self.api_calls is not None:
            self.api_calls.stop()
        self.gc_pauses = collections.stop()
        gaps = list(rec.gaps)
        return {
            "cost_observations_from": first_observation,  # this pass's first entry in `cost_observations`
            "long_ttft_s": rec.first[n],
            **gap_summary(gaps, gaps[:before], gaps[before:]),
            "steps": self._contended_steps(),
            "longest_gap": self._longest_gap(),
            "gc": gc_pauses.summary(self.gc_pauses),  # Python's collections in the pass, any thread
            "decode_traces": len(self._decode_traces(self.pass_started, math.inf)),  # compiled decode shapes traced
            # MLX's peak over the pass against one pool layer's K: a layer copied behind a step in flight (a write
            # MLX could not do in place) lifts the peak by at least that much
            "peak_above_start_mb": round((mx.get_peak_memory() - active_before) / (1 << 20), 1),
            # what MLX held when the pass began, in use and in its buffer cache: a full run's third pass ran every
            # step 3-6 ms slower than its warm passes (forty-seventh run), contended-only runs' did not
            "active_start_mb": round(active_before / (1 << 20), 1),
            "cache_start_mb": round(cache_before / (1 << 20), 1),
            # and at its end, beside MLX's limits: the sixtieth run's one slow 30B-A3B pass on the H100 (every step
            # ~20% slower) began with 2.0 GB cached where sixty others began with 6.4-6.5, all near MLX's memory
            # limit, past which a cache miss releases cached buffers (cudaFree) before it allocates
            "cache_end_mb": round(mx.get_cache_memory() / (1 << 20), 1),
            "cache_limit_mb": round((self.engine.memory_limits.cache or 0) / (1 << 20), 1),
            "memory_limit_mb": round(mlx_memory_limit() / (1 << 20), 1),
            "pool_layer_mb": round(getattr(self.engine.pool.keys[0], "nbytes", 0) / (1 << 20), 1),
        }

    def _longest_gap(self) -> dict | None:
        """The engine thread during the pass's longest inter-token gap: every span (planning, submission, ...) and
        step that overlaps it, in ms from the gap's start. On the H200 it was one submission span each time, the
        next step queued while the finished one's tokens waited (twenty-third run)."""
        commits: dict[str, list[float]] = {}
        for e in self.sink.events:
            if isinstance(e, TokenCommitted):
                commits.setdefault(e.request_id, []).append(e.t)
        gaps = [(b - a, a, b, rid) for rid, times in commits.items() for a, b in zip(times, times[1:])]
        if not gaps:
            return None
        gap, start, end, request_id = max(gaps)

        def ms(t: float) -> float:
            return round((t - start) * 1e3, 2)

        spans = [[e.name, e.step_id, ms(e.start), ms(e.end)] for e in self.sink.events
                 if isinstance(e, Span) and e.end >= start and e.start <= end]  # fmt: skip
        steps = [{"step": e.step_id, "end": ms(e.t), "ms": round(e.measured_ms, 2), "prefill_rows": e.prefill_rows,
                  "decode_lanes": e.decode_lanes, "compiled": e.compiled}
                 for e in self.sink.events
                 if isinstance(e, StepExecuted) and e.t >= start and e.t - e.measured_ms / 1e3 <= end]  # fmt: skip
        result = {"ms": round(gap * 1e3, 2), "request_id": request_id, "spans": spans, "steps": steps}
        t0 = self.sink.origin  # the perf_counter() reading the sink's times count from
        if self.samples:  # where the engine thread was, as runs of one stack: [from ms, to ms, frames...]
            result["samples"] = runs(self.samples, start + t0, end + t0, start + t0)
        # collections overlapping the gap: [generation, from ms, to ms, thread]
        result["gc"] = [[p.generation, ms(p.start - t0), ms(p.end - t0), p.thread]
                        for p in gc_pauses.overlapping(self.gc_pauses, start + t0, end + t0)]  # fmt: skip
        result["decode_traces"] = [ms(t - t0) for t in self._decode_traces(start + t0, end + t0)]  # traced in the gap
        waits = self._engine_waits()
        if waits is not None:  # the engine thread blocked in MLX (wait_for_one: too many commits in flight)
            result["waits"] = [[ms(a), ms(b)] for a, b in _overlapping(waits, start, end)]
        calls = self._engine_api_calls()
        if calls is not None:  # the engine thread's CUDA calls in the gap: [domain:name, from ms, to ms]
            result["api_calls"] = [[f"{c.domain}:{c.name}", ms(c.start), ms(c.end)] for c in calls
                                   if c.end >= start and c.start <= end]  # fmt: skip
        return result

    def _decode_traces(self, start: float, end: float) -> list[float]:
        """When the compiled decode step was traced between two `perf_counter()` readings (none: not compiled)."""
        compiled = self.engine.runner.compiled
        return [] if compiled is None else [t for t in compiled.trace_times if start <= t <= end]

    def _engine_api_calls(self) -> list[ApiCall] | None:
        """The engine thread's timed CUDA calls in the sink's seconds, in order (None: API_CALLS is off)."""
        if self.api_calls is None:
            return None
        t0, tid = self.sink.origin, self.engine._thread.native_id
        return sorted((ApiCall(c.name, c.domain, c.start - t0, c.end - t0, c.tid) for c in self.api_calls.read()
                       if c.tid == tid), key=lambda c: c.start)  # fmt: skip

    def _engine_waits(self) -> list[tuple[float, float]] | None:
        """The engine thread's untimed pthread_cond_wait calls, sorted, in the sink's seconds (None: no shim)."""
        if self.host_waits is None:
            return None
        t0 = self.sink.origin  # the sink's times count from it, the shim's are perf_counter()
        return sorted((a - t0, b - t0) for a, b in self.host_waits.read(self.engine._thread.native_id))

    def _contended_steps(self) -> dict:
        """What the scheduler did while the long prompt ran: prefill rows per step, measured against predicted."""
        steps = [e for e in self.sink.events if isinstance(e, StepExecuted)]
        planned = {e.step_id: e for e in self.sink.events if isinstance(e, StepPlanned)}
        mixed = [e for e in steps if e.prefill_rows and e.decode_lanes]
        alone = [e for e in steps if not e.prefill_rows]

        def med(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        result = {
            "mixed_steps": len(mixed),
            "decode_only_steps": len(alone),
            "mixed_rows_p50": med([e.prefill_rows for e in mixed]),
            "mixed_ms_p50": med([e.measured_ms for e in mixed]),
            "mixed_ms_max": max((e.measured_ms for e in mixed), default=None),
            "mixed_predicted_ms_p50": med([e.predicted_ms for e in mixed if e.predicted_ms is not None]),
            "decode_only_ms_p50": med([e.measured_ms for e in alone]),
            # the host's share of a mixed step (building and queuing its graph is its fixed cost on CUDA)
            "mixed_host_ms_p50": self._phases({e.step_id for e in mixed}),
            # every step with prefill in order, [prefill rows, decode lanes, row-weighted history, ms, predicted ms,
            # prefill lanes, auxiliary, compiled, why auxiliary]: how the cost model's predictions track the chunk
            # sizes it chose (and the ones it did not try); a replay of the cost model needs the lanes (multi-prompt
            # start-up steps), which steps the live model did not train on (a compiled shape's trace rode along, a
            # stand-in: "stand-in ROWSxHISTORY" names the trace it replayed) and which replayed a trace
            "prefill_steps": [
                [e.prefill_rows, e.decode_lanes, round(e.weighted_history), round(e.measured_ms, 2),
                 None if e.predicted_ms is None else round(e.predicted_ms, 2), e.prefill_width, e.auxiliary, e.compiled,
                 e.one_off]
                for e in steps if e.prefill_rows
            ],  # fmt: skip
            # the budget each of those steps was planned with, why ("halved:2+half", "contended+slack", ...) and what
            # it was planned to take at most (None: uncontended): a step smaller than the target allows says which
            # rule held it back, one predicted over its limit that a row-tile fill grew it (`checked_fill`)
            "prefill_budgets": [_budget_of(planned.get(e.step_id)) for e in steps if e.prefill_rows],
            "decode_debt_steps": sum(p.budget_reason == "decode-debt" for p in planned.values()),
            # where the longest gaps come from
            "slowest": [
                {"step": e.step_id, "prefill_rows": e.prefill_rows, "decode_lanes": e.decode_lanes,
                 "history": round(e.weighted_history), "ms": round(e.measured_ms, 1),
                 "predicted_ms": None if e.predicted_ms is None else round(e.predicted_ms, 1)}
                for e in sorted(steps, key=lambda e: -e.measured_ms)[:6]
            ],  # fmt: skip
        }
        if self.samples:
            result["queue_split"] = self._queue_split([e for e in steps if e.prefill_rows])
        waits = self._engine_waits()
        if waits is not None:
            # `dropped`: waits past the shim's capacity, missing from the figures
            summary = _submission_waits(self.sink.events, waits, mixed, alone)
            result["submission_waits"] = {**summary, "dropped": self.host_waits.dropped()}
        calls = self._engine_api_calls()
        if calls is not None:  # which CUDA calls the submissions of steps with prefill spent their time in
            with_prefill = {e.step_id for e in mixed}
            spans = [api_trace.Span("submit", e.step_id, e.start, e.end, self.engine._thread.native_id)
                     for e in self.sink.events
                     if isinstance(e, Span) and e.name == "submission" and e.step_id in with_prefill]  # fmt: skip
            result["submission_api_calls"] = api_trace.summarize(calls, spans)
            # CUptiResult of the subscription (0: timed; 999 without a driver) and calls past the shim's capacity
            result["api_calls_status"] = {"cupti_result": self.api_calls_result, "dropped": self.api_calls.dropped()}
        return result

    def _queue_split(self, steps: list[StepExecuted]) -> list[list]:
        """Each step's submission split by the stack samples: [step, prefill rows, compiled, first of its shape,
        submission ms, ms inside `mx.async_eval` (MLX encoding and queuing the graph; the rest is Python building
        it)]."""
        spans = {e.step_id: e for e in self.sink.events if isinstance(e, Span) and e.name == "submission"}
        t0 = self.sink.origin
        split = []
        for e in steps:
            span = spans.get(e.step_id)
            if span is None:
                continue
            queued = time_in(self.samples, span.start + t0, span.end + t0, _in_queue)
            split.append([e.step_id, e.prefill_rows, e.compiled, e.auxiliary, round((span.end - span.start) * 1e3, 2),
                          round(queued, 2)])  # fmt: skip
        return split

    def shared_prefix(self, prompts: Prompts, p: BenchParams) -> dict:
        prefix = prompts.one(p.prefix_len)
        result = {}
        # "again": a second continuation, which tells a first-use cost of the warm one from its steady cost
        for name in ("cold", "warm", "again"):
            self.recorder.reset()
            self.sink.events.clear()
            t0 = time.perf_counter()
            (completion,) = self._run([prefix + prompts.one(p.suffix_len)], 1)
            result[f"{name}_ttft_s"] = self.recorder.first[-1]
            result[f"{name}_wall_s"] = time.perf_counter() - t0
            result[f"{name}_cached_tokens"] = completion.usage.cached_tokens
            # where a continuation's TTFT goes: its steps (an eager one pays its build on the host) and the host phases
            result[f"{name}_steps"] = [
                {"rows": e.rows, "ms": round(e.measured_ms, 2), "compiled": e.compiled}
                for e in self.sink.events if isinstance(e, StepExecuted)
            ]  # fmt: skip
            phases: dict[str, float] = {}
            for e in self.sink.events:
                if isinstance(e, Span):
                    phases[e.name] = round(phases.get(e.name, 0.0) + (e.end - e.start) * 1e3, 2)
            result[f"{name}_phases_ms"] = phases
        result["ratio"] = result["warm_ttft_s"] / result["cold_ttft_s"]
        result["again_ratio"] = result["again_ttft_s"] / result["cold_ttft_s"]
        return result


def _api_calls() -> ApiCalls | None:
    api, reason = ApiCalls.load()
    if api is None:
        print(f"API_CALLS=1: not timing CUDA calls: {reason}", flush=True)
    return api


def _in_queue(frame: str) -> bool:
    """A sampled frame in `ModelRunner._queue`: its Python is a few lines around `mx.async_eval`, which releases the
    GIL while MLX encodes and queues the step, so the samples there are that."""
    return frame.startswith("runner.py:") and frame.endswith(" _queue")


def _overlapping(waits: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The waits (one thread's: sorted and disjoint, so their ends are sorted too) that overlap [start, end]."""
    first = bisect.bisect_left(waits, start, key=lambda w: w[1])
    last = bisect.bisect_right(waits, end, key=lambda w: w[0])
    return waits[first:last]


def _submission_waits(events: list, waits: list[tuple[float, float]], mixed: list, alone: list) -> dict:
    """How long the engine thread was blocked in MLX inside each step's submission span: p50 and max of the
    submission ms and of its wait ms over mixed and decode-only steps, and the six submissions that waited most."""
    per = {e.step_id: (1e3 * (e.end - e.start), overlap_ms(_overlapping(waits, e.start, e.end), e.start, e.end))
           for e in events if isinstance(e, Span) and e.name == "submission"}  # fmt: skip

    def summary(steps: list[StepExecuted]) -> dict:
        rows = [per[e.step_id] for e in steps if e.step_id in per]
        if not rows:
            return {"steps": 0}
        sub, wait = [s for s, _ in rows], [w for _, w in rows]
        return {"steps": len(rows), "submission_ms_p50": round(statistics.median(sub), 3),
                "submission_ms_max": round(max(sub), 3), "wait_ms_p50": round(statistics.median(wait), 3),
                "wait_ms_max": round(max(wait), 3)}  # fmt: skip

    most = sorted(per.items(), key=lambda item: -item[1][1])[:6]
    return {"mixed": summary(mixed), "decode_only": summary(alone),
            "most_waited": [[step, round(s, 3), round(w, 3)] for step, (s, w) in most]}  # fmt: skip


def _budget_of(plan: StepPlanned | None) -> list | None:
    """[row budget, reason, limit ms (None: uncontended)] of a planned step (None: its plan was not traced)."""
    if plan is None:
        return None
    return [plan.row_budget, plan.budget_reason, None if plan.limit_ms is None else round(plan.limit_ms, 2)]
