"""The engine: one thread owns MLX and runs the step loop; callers submit and read events.

    plan = scheduler.schedule(now)
    output = runner.execute(plan)
    scheduler.update(plan, output.outcome, now)

Everything else (admitting submissions, cancelling, turning tokens into events) hangs off that loop.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Any

from mlx_serve.config import EngineConfig
from mlx_serve.errors import ContextLengthExceeded, EngineStopped, InvalidRequest, QueueFull
from mlx_serve.handle import RequestHandle
from mlx_serve.outputs import RequestStream, with_usage
from mlx_serve.types import Completion, GenerationRequest, TokenEvent
from scheduler import (
    FinishReason,
    LaneKind,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepOutcome,
    StepPlan,
)
from scheduler.plan import PENDING_TOKEN
from tracing.events import RequestArrived, RequestFinished, Span, StepExecuted, TokenCommitted
from tracing.sink import sink_from_env

log = logging.getLogger("mlx_serve.engine")

__all__ = ["Engine", "EngineConfig", "RequestHandle"]


class NullObserver:
    """The metrics hooks the engine calls (from its own thread); the server supplies a real one."""

    def on_step(self, elapsed_ms: float, rows: int, prefill_rows: int, decode_lanes: int, budget_halvings: int) -> None:
        pass

    def on_first_token(self, ttft_s: float) -> None:
        pass

    def on_token_gap(self, gap_s: float) -> None:
        pass

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _InFlight:
    step: Any  # the runner's InFlightStep
    pending: tuple[tuple[Request, int], ...]  # requests holding a placeholder token, and its index in output_ids
    t0: float  # trace times of planning and submission, for the step's spans
    t1: float


@dataclass(slots=True)
class _Submission:
    request: Request
    stream: RequestStream
    handle: RequestHandle
    sampling: Any


class Engine:
    def __init__(self, config: EngineConfig, loaded: Any, num_blocks: int) -> None:
        from mlx_serve.kv_pool import KVPool
        from mlx_serve.runner import ModelRunner

        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_id: str = loaded.model_id
        self.context_length: int = loaded.context_length
        self.vocab_size: int = loaded.vocab_size
        self.trace = config.trace if config.trace is not None else sink_from_env()  # $MLX_SERVE_TRACE
        self.observer = config.observer or NullObserver()
        self.pool = KVPool(loaded.layout, num_blocks, config.block_size)
        self.runner = ModelRunner(
            loaded.model,
            self.pool,
            _decode_attention(config.decode_attention),
            prefill_lane=_prefill_lane(config, loaded, self.trace),
            lane_timeout_s=config.ane_timeout_s,
        )
        self.scheduler = Scheduler(self._scheduler_config(num_blocks), trace=self.trace)
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self._lock = threading.Lock()  # guards scheduler state read by status()/stats() from other threads
        self._submissions: queue.Queue[_Submission] = queue.Queue()
        self._cancellations: queue.Queue[tuple[str, FinishReason]] = queue.Queue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._outstanding = 0  # submitted and not yet finished (guarded by _count_lock)
        self._count_lock = threading.Lock()
        self._counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "steps"), 0)
        self._stopping = False
        self._in_flight: _InFlight | None = None  # a decode-only step whose tokens are not read back yet
        self._ids = itertools.count()
        self._drained = threading.Event()
        self._thread = threading.Thread(
            target=_engine_thread, args=(weakref.ref(self),), name="mlx-serve-engine", daemon=True
        )
        self._thread.start()

    # construction ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, config: EngineConfig | None = None) -> Engine:
        """Load the model through mlx-lm, size the KV pool from the memory budget, start the engine thread."""
        from mlx_serve.model_loading import kv_pool_blocks, load_model

        config = config or EngineConfig()
        loaded = load_model(config)
        return cls(config, loaded, kv_pool_blocks(config, loaded))

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, model_config: dict, config: EngineConfig | None = None) -> Engine:
        """An engine over a model already in memory (benchmarks build big dummy models without a disk copy)."""
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from mlx_serve.model_loading import describe_model, kv_pool_blocks
        from mlx_serve.model_source import check_supported

        config = config or EngineConfig()
        check_supported(model_config)
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        loaded = describe_model(model, tokenizer, model_config, config.model or "in-memory", config)
        return cls(config, loaded, kv_pool_blocks(config, loaded))

    def _scheduler_config(self, num_blocks: int) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=c.block_size,
            max_running=c.max_running,
            queue_limit=c.queue_limit + c.max_running,  # the engine refuses first, synchronously, in submit()
            max_model_len=self.context_length,
            step_target_ms=c.step_target_ms,
            row_ceiling=c.row_ceiling,
            row_floor=c.row_floor,
            cost_model=c.cost_model,
            max_overtakes=c.max_overtakes,
            decode_debt=c.decode_debt,
            enable_prefix_cache=c.enable_prefix_cache,
            ane_lane=c.ane_lane != "off",
        )

    # the caller's side (any thread) ------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises InvalidRequest, ContextLengthExceeded or QueueFull at once."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self._validate(request)
        with self._count_lock:
            if self._outstanding >= self.config.queue_limit + self.config.max_running:
                raise QueueFull(f"the request queue is full ({self.config.queue_limit} waiting); retry later")
            self._outstanding += 1
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        handle = RequestHandle(request_id, self.cancel)
        now = time.perf_counter()
        stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else self._eos_ids)
        sched_request = Request(
            request_id=request_id,
            prompt_ids=list(request.prompt_ids),
            max_tokens=request.max_tokens,
            priority=request.priority,
            cache_salt=request.cache_salt,
            stop_token_ids=stop_ids,
            arrival_time=now,
        )
        stream = RequestStream(request_id, request, self.tokenizer.detokenizer, arrival=now)
        self._submissions.put(_Submission(sched_request, stream, handle, request.sampling))
        self._wakeup.set()
        return handle

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._cancellations.put((request_id, reason))
        self._wakeup.set()

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Blocking: run every request to completion (offline use). Call from a thread without an event loop."""
        handles = [self.submit(r) for r in requests]
        return [self._collect(h) for h in handles]

    def _collect(self, handle: RequestHandle) -> Completion:
        events = list(handle)
        last = events[-1]
        tokens = tuple(e.token_id for e in events if e.token_id is not None)
        logprobs = tuple(e.logprob for e in events if e.logprob is not None)
        return Completion(
            request_id=handle.request_id,
            token_ids=tokens,
            text="".join(e.text for e in events),
            finish_reason=last.finish_reason or "error",
            usage=last.usage,
            logprobs=logprobs or None,
            error=last.error,
        )

    def _validate(self, request: GenerationRequest) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {request.max_tokens!r}", param="max_tokens")
        bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids outside the vocabulary: {bad[:5]}", param="prompt")
        request.sampling.validate(self.vocab_size)
        if n + request.max_tokens > self.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{n + request.max_tokens} tokens ({n} in the prompt, {request.max_tokens} for the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
                param="max_tokens" if n < self.context_length else "messages",
            )
        capacity = self.pool.num_blocks * self.pool.block_size
        if n + request.max_tokens > capacity:
            raise ContextLengthExceeded(
                f"the request needs up to {n + request.max_tokens} tokens of KV cache but the pool holds "
                f"{capacity} (raise --memory-budget-gb or lower max_tokens)",
                param="max_tokens",
            )

    # introspection (any thread) ----------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            requests = [_request_status(r) for r in self.scheduler.requests()]
            stats = self.scheduler.stats
            blocks = self.scheduler.blocks
            return {
                "model": self.model_id,
                "requests": requests,
                "counters": {
                    "steps": stats.steps,
                    "prefill_rows": stats.prefill_rows,
                    "decode_rows": stats.decode_rows,
                    "contended_prefill_rows": stats.contended_prefill_rows,
                    "preemptions": stats.preemptions,
                    "budget_halvings": stats.budget_halvings,
                    "prefix_hit_tokens": stats.prefix_hit_tokens,
                },
                "kv": {
                    "blocks_total": blocks.num_blocks,
                    "blocks_used": blocks.num_used_blocks,
                    "blocks_cached": blocks.num_cached_blocks,
                    "block_size": self.pool.block_size,
                },
            }

    def stats(self) -> dict:
        with self._lock:
            s, blocks = self.scheduler.stats, self.scheduler.blocks
            return {
                "queue_depth": self.scheduler.num_waiting,
                "running": self.scheduler.num_running,
                "kv_blocks_total": blocks.num_blocks,
                "kv_blocks_used": blocks.num_used_blocks,
                "kv_blocks_cached": blocks.num_cached_blocks,
                "prefix_hit_tokens_total": s.prefix_hit_tokens,
                "prompt_tokens_total": self._counters["prompt_tokens"],
                "generation_tokens_total": self._counters["generation_tokens"],
                "steps_total": s.steps,
                "budget_halvings_total": s.budget_halvings,
                "preemptions_total": s.preemptions,
            }

    def allocation_summary(self) -> str:
        """What the engine holds: weights and the KV pool, in real bytes (quantized weights included)."""
        pool = self.pool
        tokens = pool.num_blocks * pool.block_size
        return (
            f"{self.model_id}: weights {_size(self.loaded.weight_bytes)}; KV pool {_size(pool.nbytes)} "
            f"= {pool.num_blocks} blocks x {pool.block_size} tokens ({tokens} tokens, "
            f"{self.loaded.layout.bytes_per_token()} bytes/token); context {self.context_length} tokens"
        )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout_s`, cancel the rest, stop."""
        self._stopping = True
        self._wakeup.set()
        if not self._drained.wait(timeout_s):
            for request_id in list(self._handles):
                self.cancel(request_id)
            self._drained.wait(5.0)
        close = getattr(self.trace, "close", None)
        if callable(close):
            close(complete=self._drained.is_set())  # dumps the capture if it has a path

    # the engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._admit()
            if self._stopping and not self._handles:
                return
            if not self.scheduler.has_work and self._in_flight is None:
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            if not self._step():
                self._wakeup.wait(0.01)  # nothing runnable (e.g. waiting for blocks): do not spin
                self._wakeup.clear()

    def _admit(self) -> None:
        t0 = self.trace.now()
        while True:
            try:
                request_id, reason = self._cancellations.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                request = self.scheduler.cancel(request_id, reason)
            if request is not None or request_id in self._handles:
                self._finish(request_id, reason.value, request)
        while True:
            try:
                sub = self._submissions.get_nowait()
            except queue.Empty:
                break
            self._accept(sub)
        if self.trace.enabled:
            self.trace.emit(Span("admission", t0, self.trace.now()))

    def _accept(self, sub: _Submission) -> None:
        rid = sub.request.request_id
        try:
            with self._lock:
                self.scheduler.add(sub.request)
        except Exception as exc:  # QueueFull / RequestTooLarge from the scheduler: refuse this one only
            self._streams[rid], self._handles[rid] = sub.stream, sub.handle
            self._finish(rid, "error", None, error=str(exc))
            return
        self.runner.add_request(rid, sub.sampling)
        self._streams[rid], self._handles[rid] = sub.stream, sub.handle
        if self.trace.enabled:
            r = sub.request
            self.trace.emit(RequestArrived(self.trace.now(), rid, r.num_prompt_tokens, r.max_tokens, r.priority))

    def _step(self) -> bool:
        """Plan, queue and account one step. A decode-only step is left in flight: its tokens are read back
        while the next step is already queued behind it (see docs/DESIGN.md, "One step in flight")."""
        trace = self.trace
        t0 = trace.now()
        with self._lock:
            plan = self.scheduler.schedule(time.perf_counter())
        if plan.is_empty:
            return self._complete_in_flight()
        t1 = trace.now()
        previous = self._in_flight
        try:
            step = self.runner.submit(plan, previous.step if previous else None)
        except Exception as exc:  # an MLX failure fails this step's requests, never the engine
            log.exception("step %d failed", plan.step_id)
            self._complete_in_flight()
            self._fail_plan(plan, exc)
            return True
        self._complete_in_flight()
        if self.config.pipeline and _decode_only(plan):
            placeholders = StepOutcome({lane.request_id: PENDING_TOKEN for lane in plan.lanes}, math.nan)
            with self._lock:
                advanced = self.scheduler.update(plan, placeholders, time.perf_counter())
            pending = tuple((r, len(r.output_ids) - 1) for r in advanced)
            self._in_flight = _InFlight(step, pending, t0, t1)
            return True
        output = self._read_back(step, plan)
        if output is None:
            return True
        t2 = trace.now()
        with self._lock:
            advanced = self.scheduler.update(plan, output.outcome, time.perf_counter())
        for request in advanced:
            self._publish(request, output.samples.get(request.request_id))
        self._account(plan, output, t0, t1, t2)
        return True

    def _complete_in_flight(self) -> bool:
        """Read back the step left in flight: put its real tokens where the placeholders are, then publish."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return False
        plan = in_flight.step.plan
        output = self._read_back(in_flight.step, plan)
        if output is None:
            return True
        t2 = self.trace.now()
        for request, index in in_flight.pending:
            sample = output.samples.get(request.request_id)
            if sample is None or request.request_id not in self._handles:
                continue
            request.output_ids[index] = sample.token_id
            if sample.token_id in request.stop_token_ids:
                with self._lock:
                    self.scheduler.cancel(request.request_id, FinishReason.STOP)
                request.finish_reason = FinishReason.STOP
            self._publish(request, sample)
        self._account(plan, output, in_flight.t0, in_flight.t1, t2)
        return True

    def _read_back(self, step: Any, plan: StepPlan) -> Any:
        try:
            return self.runner.collect(step)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            self._fail_plan(plan, exc)
            return None

    def _account(self, plan: StepPlan, output: Any, t0: float, t1: float, t2: float) -> None:
        self._counters["steps"] += 1
        self._counters["prompt_tokens"] += plan.prefill_rows
        self.observer.on_step(
            output.outcome.elapsed_ms, plan.num_rows, plan.prefill_rows,
            sum(1 for lane in plan.lanes if lane.kind.value == "decode"), plan.budget_reason.count("halved"),
        )
        if self.trace.enabled:
            self._trace_step(plan, output, t0, t1, t2)

    def _publish(self, request: Request, sample: Any) -> None:
        rid = request.request_id
        stream = self._streams.get(rid)
        if stream is None or sample is None:
            return
        finished = request.state is RequestState.FINISHED
        reason = request.finish_reason.value if finished and request.finish_reason else None
        is_stop_token = finished and request.finish_reason is FinishReason.STOP
        gap_from = stream.last_token_time
        event, stop_hit = stream.add_token(sample.token_id, sample.logprob, sample.top_logprobs, reason, is_stop_token)
        self._counters["generation_tokens"] += 1
        if gap_from is None:
            self.observer.on_first_token(stream.first_token_time - stream.arrival)
        else:
            self.observer.on_token_gap(stream.last_token_time - gap_from)
        if self.trace.enabled:
            self.trace.emit(TokenCommitted(self.trace.now(), rid, event.index))
        if stop_hit:
            if not finished:
                with self._lock:
                    self.scheduler.cancel(rid, FinishReason.STOP)
            finished, reason = True, "stop"
        if finished:
            self._finish(rid, reason or "stop", request, last_event=event)
        else:
            self._handles[rid].push(event)

    def _finish(
        self, rid: str, reason: str, request: Request | None, last_event: TokenEvent | None = None, error: str | None = None
    ) -> None:
        """Send the final event (with usage), free per-request state. Exactly once per request."""
        handle, stream = self._handles.pop(rid, None), self._streams.pop(rid, None)
        if handle is None:
            return
        self.runner.release([rid])
        with self._count_lock:
            self._outstanding -= 1
        prompt = len(stream.request.prompt_ids) if stream else 0
        completion = len(stream.token_ids) if stream else 0
        cached = request.num_cached_tokens if request else 0
        event = last_event or TokenEvent(rid, None, "", finish_reason=reason, error=error)
        event = with_usage(event, prompt, completion, cached)
        if event.finish_reason != reason:
            event = replace(event, finish_reason=reason)
        handle.push(event)
        self.observer.on_finish(reason, prompt, completion, cached)
        if self.trace.enabled:
            self.trace.emit(RequestFinished(self.trace.now(), rid, reason, prompt, completion, cached))

    def _fail_plan(self, plan: StepPlan, exc: Exception) -> None:
        for lane in plan.lanes:
            with self._lock:
                request = self.scheduler.cancel(lane.request_id, FinishReason.ERROR)
            self._finish(lane.request_id, "error", request, error=f"engine step failed: {exc}")

    def _trace_step(self, plan: StepPlan, output: Any, t0: float, t1: float, t2: float) -> None:
        trace, now = self.trace, self.trace.now()
        trace.emit(Span("planning", t0, t1, plan.step_id))
        for name in ("preparation", "submission", "consumption"):
            trace.emit(Span(name, t1, t1 + output.phase_ms[name] / 1e3, plan.step_id))
            t1 += output.phase_ms[name] / 1e3
        trace.emit(Span("application", t2, now, plan.step_id))
        for span in output.lane_spans:
            trace.emit(span)
        prefill = [lane for lane in plan.lanes if lane.kind.value == "prefill"]
        rows = sum(lane.rows for lane in prefill)
        paths = {lane.path.value for lane in prefill} or {"gpu"}
        trace.emit(
            StepExecuted(
                t=now,
                step_id=plan.step_id,
                measured_ms=output.outcome.elapsed_ms,
                rows=plan.num_rows,
                prefill_rows=rows,
                decode_lanes=len(plan.lanes) - len(prefill),
                prefill_width=len(prefill),
                weighted_history=sum(lane.history * lane.rows for lane in prefill) / rows if rows else 0.0,
                path=paths.pop() if len(paths) == 1 else "mixed",
                predicted_ms=plan.predicted_ms,
            )
        )


def _decode_only(plan: StepPlan) -> bool:
    """Steps that may stay in flight: every lane one decode row (prefill steps train the cost model and need
    their exact time; ANE chunks are prefill)."""
    return all(lane.kind is LaneKind.DECODE for lane in plan.lanes)


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def _engine_thread(engine_ref: weakref.ref) -> None:
    """Run the loop, then park instead of returning.

    A returning thread destroys MLX's thread-local state (its compile cache) after `join()` has returned, and
    that destructor takes the GIL: at interpreter exit this aborts the process. A parked daemon thread is never
    torn down. It keeps no reference to the engine, so the model and KV pool are freed as usual.
    """
    engine = engine_ref()
    if engine is not None:
        try:
            engine._loop()
        finally:
            engine._drained.set()
    del engine
    threading.Event().wait()


def _decode_attention(kind: str) -> Any:
    """The attention function for single-row lanes; None means the runner's exact reference path."""
    if kind == "reference":
        return None
    from mlx_serve.kernels.paged_attention import select_decode_attention

    return select_decode_attention(kind)


def _prefill_lane(config: EngineConfig, loaded: Any, trace: Any) -> Any:
    """The ANE lane for `--ane-lane`: None when off; the CPU stand-in; or Core ML (macOS) over a built package."""
    if config.ane_lane == "off":
        return None
    from mlx_serve.ane.lane import make_lane

    clock = trace.now if trace.enabled else time.perf_counter
    if config.ane_lane == "cpu":
        return make_lane("cpu", loaded.model, clock=clock)
    if config.ane_lane != "ane":
        raise InvalidRequest(f"--ane-lane must be off, cpu or ane, not {config.ane_lane!r}", param="ane_lane")
    if config.ane_package is None:
        raise InvalidRequest(
            "--ane-lane ane needs a Core ML package: build one with `python -m mlx_serve ane build --model DIR "
            "--out PKG` and pass --ane-package PKG",
            param="ane_package",
        )
    return make_lane("coreml", loaded.model, package=config.ane_package, clock=clock)


def _request_status(r: Request) -> dict:
    phase = {
        RequestState.WAITING: "waiting",
        RequestState.PREFILLING: "prefilling",
        RequestState.DECODING: "decoding",
        RequestState.PREEMPTED: "preempted",
    }.get(r.state, "finished")
    return {
        "id": r.request_id,
        "phase": phase,
        "priority": int(r.priority),
        "prompt_tokens": r.num_prompt_tokens,
        "computed_tokens": min(r.num_computed, r.num_prompt_tokens),
        "output_tokens": len(r.output_ids),
        "cached_tokens": r.num_cached_tokens,
        "arrival_s": r.arrival_time,
    }
