"""The engine: one thread owns MLX and runs the step loop; callers submit and read events.

    plan = scheduler.schedule(now)
    output = runner.execute(plan)
    scheduler.update(plan, output.outcome, now)

Everything else (admitting submissions, cancelling, turning tokens into events) hangs off that loop.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from mlx_serve import engine_setup, introspection
from mlx_serve.adapter_leases import AdapterLeases
from mlx_serve.adapter_specs import AdapterSource, AdapterSpec, check_specs, read_adapter_source
from mlx_serve.config import EngineConfig
from mlx_serve.delivery import Delivery, NullObserver
from mlx_serve.errors import EngineStopped, InvalidRequest
from mlx_serve.grammar import Grammars
from mlx_serve.handle import RequestHandle, submit_each
from mlx_serve.kernels.paged_attention import cuda_available
from mlx_serve.outputs import RequestStream
from mlx_serve.ragged import PagedChunkAttention
from mlx_serve.step_trace import trace_step
from mlx_serve.types import Completion, GenerationRequest
from scheduler import FinishReason, Request, Scheduler, StepOutcome, StepPlan
from scheduler.plan import PENDING_TOKEN
from tracing.events import RequestArrived, Span
from tracing.sink import sink_from_env

log = logging.getLogger("mlx_serve.engine")
# quiet time before the engine traces deferred compiled shapes: a request arriving mid-trace waits for it (H200:
# a shared-prefix continuation sent as the cold request finished waited 16-40 ms when traces began at once)
TRACE_AFTER_IDLE_S = 0.5

__all__ = ["Engine", "EngineConfig", "RequestHandle"]


@dataclass(frozen=True, slots=True)
class _InFlight:
    step: Any  # the runner's InFlightStep
    pending: tuple[tuple[Request, int], ...]  # requests holding a placeholder token, and its index in output_ids
    t0: float  # trace times of planning and submission, for the step's spans
    t1: float


@dataclass(frozen=True, slots=True)
class _Control:
    work: Callable[[], Any]  # run on the engine thread between steps
    done: Future


@dataclass(slots=True)
class _Submission:
    request: Request
    stream: RequestStream
    handle: RequestHandle
    sampling: Any
    adapter: int = 0  # the adapter's slot in the adapted linears (0: the base model)


class Engine:
    def __init__(self, config: EngineConfig, loaded: Any, num_blocks: int, window_blocks: int = 0) -> None:
        from mlx_serve.kv_pool import KVPool
        from mlx_serve.model_loading import state_slots
        from mlx_serve.recurrent import StatePool

        if loaded.state_layers or loaded.layout.latent:  # regrouped mixers and latent attention run eager
            config = replace(config, compile_decode="off")
        live_states, snapshots = state_slots(config, loaded)
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size)  # response_format constraints
        self.model_id: str = loaded.model_id
        self.context_length: int = loaded.context_length
        self.vocab_size: int = loaded.vocab_size
        self.trace = config.trace if config.trace is not None else sink_from_env()  # $MLX_SERVE_TRACE
        self.observer = config.observer or NullObserver()
        self.pool = KVPool(loaded.layout, num_blocks, config.block_size, window_blocks)
        states = StatePool(loaded.state_shapes, live_states, snapshots) if live_states else None
        self.runner = engine_setup.model_runner(config, loaded, self.pool, self.trace, states)
        self._speculate = engine_setup.speculative_tokens(config)
        self.drafter = None  # a draft model's drafts (`--draft-model`); None: prompt lookup where speculating
        if loaded.draft is not None:
            from mlx_serve.draft_model import DraftModel

            self.drafter = DraftModel(loaded.draft, config.draft_kv_tokens)
        self.scheduler = Scheduler(
            engine_setup.scheduler_config(
                config, num_blocks, self.context_length,
                engine_setup.row_quantum(config.row_quantum, self.runner.quantized_projections > 0),
                self.runner.kv_bucket if config.plan_padding else 0,
                not isinstance(self.runner.chunk_attention, PagedChunkAttention),
                loaded.layout.widest_window, self.pool.window_blocks, bool(live_states), snapshots,
            ),
            trace=self.trace,
            traced_shapes=self.runner.traced_shapes(config.price_stand_ins),
            drafts=self.drafter,
        )
        self.delivery = Delivery(self.observer, self.trace, self._finish_on_stop_string, self._closed)
        self._controls: queue.Queue[_Control] = queue.Queue()  # work for the engine thread between steps
        self._leases = AdapterLeases()  # which open requests hold which adapter
        self.adapter_bytes = loaded.adapters.stack_bytes if loaded.adapters is not None else 0
        # adapters loaded while serving may grow the stacks by the share of memory kept from the KV pool for them
        self.adapter_limit_bytes = self.adapter_bytes + int(config.adapter_memory_gb * (1 << 30))
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self._lock = threading.Lock()  # guards scheduler state read by status()/stats() from other threads
        self._submissions: queue.Queue[_Submission] = queue.Queue()
        self._taken: collections.deque[_Submission] = collections.deque()  # drained, not yet accepted or refused
        self._arrivals = threading.Lock()  # held while a batch is queued, so the engine admits it in one step
        self._cancellations: queue.Queue[tuple[str, FinishReason]] = queue.Queue()
        self._wakeup = threading.Event()
        self._prompt_rows = 0  # prompt rows computed (prefix-cache hits excluded)
        self._stopping = False
        self.failure: str | None = None  # why the engine thread stopped on its own (a bug); None while it runs
        self._in_flight: _InFlight | None = None  # a step whose tokens are not read back yet
        self._busy_at = time.monotonic()  # when the loop last had work (deferred traces wait for quiet)
        self.warmed: tuple[int, float] = (0, 0.0)  # attention shapes built before serving, and the seconds it took
        self._drained = threading.Event()
        self._thread = threading.Thread(
            target=_engine_thread, args=(weakref.ref(self),), name="mlx-serve-engine", daemon=True
        )
        # MLX's limits are process-wide: held last, so a setting refused above holds none, and given back when the
        # engine shuts down or, never shut down, is collected
        self.memory_limits = engine_setup.memory_limits(config, loaded, self.pool.nbytes)
        weakref.finalize(self, self.memory_limits.restore)
        self._thread.start()

    # construction ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, config: EngineConfig | None = None) -> Engine:
        """Load the model through mlx-lm, size the KV pool from the memory budget, start the engine thread."""
        from mlx_serve.model_loading import kv_pool_size, load_model

        config = config or EngineConfig()
        engine_setup.check_settings(config)  # before the load, which can take minutes
        loaded = load_model(config)
        size = kv_pool_size(config, loaded)
        return cls(config, loaded, size.blocks, size.window_blocks)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, model_config: dict, config: EngineConfig | None = None) -> Engine:
        """An engine over a model already in memory (benchmarks build big dummy models without a disk copy)."""
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from mlx_serve.model_loading import describe_model, kv_pool_size
        from mlx_serve.model_source import check_supported

        config = config or EngineConfig()
        engine_setup.check_settings(config)
        check_supported(model_config)
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        loaded = describe_model(model, tokenizer, model_config, config.model or "in-memory", config)
        size = kv_pool_size(config, loaded)
        return cls(config, loaded, size.blocks, size.window_blocks)

    # the caller's side (any thread) ------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises InvalidRequest, ContextLengthExceeded or QueueFull at once."""
        if self._stopping:
            raise EngineStopped(self.failure or "the engine is shutting down")
        capacity = self.pool.num_blocks * self.pool.block_size
        engine_setup.validate_request(request, self.vocab_size, self.context_length, capacity)
        if request.sampling.grammar is not None:
            self.grammars.check(request.sampling.grammar)
        self.delivery.reserve(self.config.queue_limit + self.config.max_running, self.config.queue_limit)
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        handle = RequestHandle(request_id, self.cancel)
        now = time.perf_counter()
        # a grammar allows end-of-sequence only once its text is complete: then it ends the request, ignore_eos or not
        keep_eos = not request.ignore_eos or request.sampling.grammar is not None
        stop_ids = frozenset(request.stop_token_ids) | (self._eos_ids if keep_eos else frozenset())
        salt = request.cache_salt
        if request.adapter is not None:  # an adapter's KV is its own
            salt = f"{salt or ''}\x00adapter:{request.adapter}"
        sched_request = Request(
            request_id=request_id,
            prompt_ids=list(request.prompt_ids),
            max_tokens=1 if request.pooling else request.max_tokens,  # an embedding's one token is not used
            priority=request.priority,
            cache_salt=salt,
            # the ANE lane's Core ML model scores all rows alike and has no adapters
            gpu_only=request.sampling.prompt_logprobs is not None or request.adapter is not None or bool(request.pooling),
            speculate=self._speculate if request.sampling.draftable else 0,
            # scoring a prompt or mean-pooling it needs every row computed: no prefix hit (its blocks still publish)
            reads_prefix_cache=request.sampling.prompt_logprobs is None and request.pooling != "mean",
            stop_token_ids=stop_ids,
            arrival_time=now,
        )
        stream = RequestStream(request_id, request, self.tokenizer.detokenizer, arrival=now)
        adapter = self._leases.take(request_id, request.adapter, self.runner.adapters)
        self._submissions.put(_Submission(sched_request, stream, handle, request.sampling, adapter))
        self._wakeup.set()
        if self.failure is not None:  # the loop failed while this was queued: nobody else will finish it
            self._fail_open_requests(self.failure)
        return handle

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served now, by name."""
        adapters = self.runner.adapters
        return adapters.names if adapters is not None else ()

    def load_adapter(self, spec: AdapterSpec, timeout_s: float = 300.0) -> None:
        """Serve another LoRA adapter: its files read here, installed by the engine thread between steps; raises
        what `--lora` would raise for it at start-up, and InvalidRequest where the stacked adapters would outgrow
        `adapter_memory_gb`."""
        check_specs([spec])
        if self.runner.states is not None or self.pool.layout.latent:
            raise InvalidRequest("adapters: not with recurrent layers or latent attention (their modules read the "
                                 "step's rows regrouped by lane, not per row)", param="lora")  # fmt: skip
        source = read_adapter_source(spec)  # the disk read on this thread: the streams never wait on it
        self._on_engine_thread(lambda: self._install_adapter(source, spec.path), timeout_s)

    def unload_adapter(self, name: str, timeout_s: float = 60.0) -> None:
        """Stop serving an adapter; refused (InvalidRequest) while requests naming it are open."""
        self._on_engine_thread(lambda: self._remove_adapter(name), timeout_s)

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._cancellations.put((request_id, reason))
        self._wakeup.set()

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests that arrive together (`n` choices, a batch): all or none, and the engine takes them in
        one admission, so a burst over one prompt can share its prefill. If one is refused, those queued before it
        are cancelled before the error goes up."""
        with self._arrivals:
            return submit_each(self.submit, requests)

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Blocking: run every request to completion (offline use). Call from a thread without an event loop."""
        return [_completion(h) for h in self.submit_all(requests)]

    # introspection (any thread) ----------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            status = introspection.status(self.scheduler, self.model_id, self.pool.block_size)
        layout = self.pool.layout  # how a token's KV is stored: the model's dtype, or quantized (--kv-bits)
        status["kv"] |= {"bits": layout.bits, "group_size": layout.group_size if layout.quantized else None,
                         "bytes_per_token": layout.bytes_per_token()}  # fmt: skip
        return {**status, "compiled_shapes": self.runner.compiled_shapes(), "adapters": list(self.adapters),
                "adapter_memory": {"bytes": self.adapter_bytes, "limit_bytes": self.adapter_limit_bytes},
                "draft_model": self._draft_status(), "recurrent_state": self._state_status()}

    def _state_status(self) -> dict | None:
        states = self.runner.states
        if states is None:
            return None
        return {"layers": len(states.layers), "slots": states.slots, "slots_in_use": states.in_use,
                "snapshots": states.snapshots, "snapshots_kept": self._snapshots_kept(),
                "bytes_per_request": self.loaded.state_bytes, "bytes": states.nbytes}  # fmt: skip

    def _snapshots_kept(self) -> int:
        with self._lock:
            snapshots = self.scheduler.snapshots
            return len(snapshots) if snapshots is not None else 0

    def _draft_status(self) -> dict | None:
        if self.drafter is None:
            return None
        return {"model": self.config.draft_model, "tokens_held": self.drafter.held_tokens,
                "tokens_limit": self.drafter.most_tokens}  # fmt: skip

    def stats(self) -> dict:
        with self._lock:
            stats = introspection.stats(self.scheduler, self._prompt_rows, self.delivery.generation_tokens)
        shapes = self.runner.compiled_shapes()
        memory = {"adapter_bytes": self.adapter_bytes, "adapter_limit_bytes": self.adapter_limit_bytes}
        if self.drafter is not None:
            memory |= {"draft_tokens_held": self.drafter.held_tokens, "draft_tokens_limit": self.drafter.most_tokens}
        if (states := self.runner.states) is not None:
            memory |= {"recurrent_slots_total": states.slots, "recurrent_slots_used": states.in_use,
                       "recurrent_snapshots_kept": self._snapshots_kept()}  # fmt: skip
        return {**stats, "compiled_shapes": shapes["decode"] + shapes["mixed"],
                "compiled_shapes_waiting": shapes["mixed_waiting"], **memory}  # fmt: skip

    def allocation_summary(self) -> str:
        summary = introspection.allocation_summary(self.model_id, self.loaded.weight_bytes, self.pool, self.context_length)
        if (states := self.runner.states) is not None:
            summary += (f"; recurrent state {introspection.size_text(states.nbytes)} = ({states.slots} requests + "
                        f"{states.snapshots} snapshots) x {self.loaded.state_bytes} bytes ({len(states.layers)} layers)")
        return f"{summary}; {self.memory_limits.describe()}"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout_s`, cancel the rest, stop."""
        self._stopping = True
        self._wakeup.set()
        if not self._drained.wait(timeout_s):
            for request_id in self.delivery.open_ids():
                self.cancel(request_id)
            self._drained.wait(5.0)
        close = getattr(self.trace, "close", None)
        if callable(close):
            close(complete=self._drained.is_set())  # dumps the capture if it has a path
        self.memory_limits.restore()  # process-wide: the next engine (or caller) starts from MLX's own

    # the engine thread -------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        """Before the first request: the attention shapes prefill chunks can meet (see ModelRunner)."""
        if not self.config.warm_up:
            return
        t0 = time.perf_counter()
        try:
            shapes = self.runner.warm_prefill_attention(self.context_length, self.config.row_ceiling)
            # the quantized matmul variants MLX compiles on first use (CUDA only: elsewhere nothing is compiled)
            products = self.runner.warm_quantized_products(self.config.row_ceiling) if cuda_available() else 0
            # and the MoE blocks' kernels (expert tiles, their layout), which compile on first use
            blocks = self.runner.warm_moe_blocks(self.config.row_ceiling) if cuda_available() else 0
            # and the paged chunk-attention kernel's forms, which compile on first use
            paged = self.runner.warm_paged_chunk_attention()
            # and the compiled shapes of a short prompt over a cached prefix, which deferral would first run eager
            traces = self.runner.warm_continuation_traces(self.context_length)
            # and each rows bucket of an eager step beside decode lanes, whose first run loads kernels
            chunk_rows = (self.runner.warm_chunk_rows(self.config.row_ceiling, self.config.warm_chunk_rows)
                          if self.config.warm_chunk_rows else 0)  # fmt: skip
        except Exception:  # a warm-up failure costs first-use time later, never the engine
            log.exception("warm-up failed")
            return
        self.warmed = (shapes, time.perf_counter() - t0)
        if shapes or products or blocks or paged or traces or chunk_rows:
            log.info("warmed %d prefill attention shapes, %d quantized products, %d MoE block forms, %d paged "
                     "chunk-attention forms, %d continuation traces and %d chunk rows buckets in %.1f s", shapes,
                     products, blocks, paged, traces, chunk_rows, self.warmed[1])  # fmt: skip

    def _loop(self) -> None:
        while True:
            self._run_controls()
            self._admit()
            self._flush()  # refusals' and cancellations' final events
            if self._stopping and not self.delivery.open_ids():
                return
            if not self.scheduler.has_work and self._in_flight is None:
                quiet_s = time.monotonic() - self._busy_at
                if quiet_s >= TRACE_AFTER_IDLE_S and self._trace_deferred():
                    continue
                self._wakeup.wait(TRACE_AFTER_IDLE_S - quiet_s if quiet_s < TRACE_AFTER_IDLE_S else 0.5)
                self._wakeup.clear()
                continue
            self._busy_at = time.monotonic()
            stepped = self._step()
            self._flush()  # the step's events: one wake-up of each reading loop
            if not stepped:
                self._wakeup.wait(0.01)  # nothing runnable (e.g. waiting for blocks): do not spin
                self._wakeup.clear()

    def _flush(self) -> None:
        t0 = self.trace.now()
        if self.delivery.flush() and self.trace.enabled:
            self.trace.emit(Span("delivery", t0, self.trace.now()))

    def _on_engine_thread(self, work: Callable[[], None], timeout_s: float) -> None:
        """Run `work` on the engine thread between steps and wait for it; its exception is raised here."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        done: Future = Future()
        self._controls.put(_Control(work, done))
        self._wakeup.set()
        done.result(timeout_s)

    def _run_controls(self) -> None:
        for control in _drain(self._controls):
            try:
                control.done.set_result(control.work())
            except Exception as exc:  # the caller gets it; the engine goes on
                control.done.set_exception(exc)

    def _install_adapter(self, source: AdapterSource, path: str) -> None:
        from mlx_serve.adapters import AdapterSet, parse_adapter

        adapter = parse_adapter(source)
        if self.runner.adapters is None:
            self.runner.adapters = AdapterSet(self.loaded.model)
        self._leases.add(self.runner.adapters, adapter, self.adapter_limit_bytes)
        self._adapters_changed()
        log.info("serving adapter %s from %s (adapters' matrices: %.1f of %.1f MiB)", source.name, path,
                 self.adapter_bytes / 2**20, self.adapter_limit_bytes / 2**20)  # fmt: skip

    def _remove_adapter(self, name: str) -> None:
        self._leases.remove(self.runner.adapters, name)
        self._adapters_changed()
        log.info("stopped serving adapter %s", name)

    def _adapters_changed(self) -> None:
        self.adapter_bytes = self.runner.adapters.stack_bytes
        if self.runner.compiled is not None:  # its adapted traces hold the old stacks
            self.runner.compiled.forget_adapter_traces()

    def _closed(self, request_id: str) -> None:
        self.runner.release_one(request_id)
        self._leases.release(request_id)
        if self.drafter is not None:
            self.drafter.discard(request_id)

    def _trace_deferred(self) -> bool:
        """With nothing to run: trace one compiled shape a step met (its steps ran eager meanwhile)."""
        try:
            return self.runner.trace_deferred()
        except Exception:  # that shape stays eager; serving goes on
            log.exception("tracing a deferred compiled shape failed")
            return True

    def _admit(self) -> None:
        t0 = self.trace.now()
        # cancellations are taken before submissions and applied after them: a request is queued before its
        # cancellation, so each one taken finds its request accepted; a refused batch is withdrawn before it runs
        with self._arrivals:
            cancellations = _drain(self._cancellations)
            submissions = _drain(self._submissions)
        self._taken.extend(submissions)
        while self._taken:
            self._accept(self._taken[0])
            self._taken.popleft()
        for request_id, reason in cancellations:
            with self._lock:
                request = self.scheduler.cancel(request_id, reason)
            if request is not None or self.delivery.is_open(request_id):
                self.delivery.finish(request_id, reason.value, request)
        if self.trace.enabled:
            self.trace.emit(Span("admission", t0, self.trace.now()))

    def _accept(self, sub: _Submission) -> None:
        rid = sub.request.request_id
        grammar = sub.sampling.grammar
        try:
            constraint = self.grammars.constraint(grammar) if grammar else None
            with self._lock:
                self.scheduler.add(sub.request)
        except Exception as exc:  # QueueFull / RequestTooLarge from the scheduler, a grammar: refuse this one only
            self._refuse(sub, exc)
            return
        try:
            self.runner.add_request(rid, sub.sampling, constraint, sub.request.prompt_ids, sub.adapter,
                                    speculate=sub.request.speculate > 0, pooling=sub.stream.request.pooling,
                                    stop_ids=sub.request.stop_token_ids)
        except Exception as exc:  # settings its sampler cannot take: this request fails, the engine serves on
            log.exception("request %s: its sampling state could not be built", rid)
            with self._lock:
                self.scheduler.cancel(rid, FinishReason.ERROR)
            self.runner.release_one(rid)
            self._refuse(sub, exc)
            return
        self.delivery.open(sub.stream, sub.handle)
        if self.trace.enabled:
            r = sub.request
            self.trace.emit(RequestArrived(self.trace.now(), rid, r.num_prompt_tokens, r.max_tokens, r.priority))

    def _refuse(self, sub: _Submission, exc: Exception) -> None:
        self.delivery.open(sub.stream, sub.handle)
        self.delivery.finish(sub.request.request_id, "error", None, error=str(exc))

    def _step(self) -> bool:
        """Plan, queue and account one step. A step that samples is left in flight (decode lanes, and prefill
        chunks riding with them): its tokens are read back while the next step is already queued behind it, so
        the host builds one step while the device runs the other (see docs/DESIGN.md, "One step in flight")."""
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
        if self.config.pipeline and self.runner.can_stay_in_flight(step):
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
        self.delivery.add_prompt_logprobs(output.prompt_logprobs)
        self.delivery.add_embeddings(output.embeddings)
        for request in advanced:
            self._publish(request, output.samples.get(request.request_id), output.accepted.get(request.request_id))
        self._account(plan, output, t0, t1, t2)
        return True

    def _publish(self, request: Request, sample: Any, accepted: list | None = None) -> None:
        """The events of the tokens the step committed: the drafts it accepted (if any), then its sample; a token
        that finished the request ends them."""
        if request.new_tokens <= 1 or sample is None:
            self.delivery.publish(request, accepted[0] if accepted and request.new_tokens == 1 else sample)
            return
        committed = [*(accepted or []), sample][: request.new_tokens]
        for token in committed[:-1]:
            self.delivery.publish(request, token, last=False)
        self.delivery.publish(request, committed[-1])

    def _complete_in_flight(self) -> bool:
        """Read back the step left in flight: put its real tokens where the placeholders are, then publish."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return False
        plan = in_flight.step.plan
        output = self._read_back(in_flight.step, plan, updated=True)
        if output is None:
            return True
        t2 = self.trace.now()
        self.delivery.add_prompt_logprobs(output.prompt_logprobs)
        self.delivery.add_embeddings(output.embeddings)
        for request, index in in_flight.pending:
            sample = output.samples.get(request.request_id)
            if sample is None or not self.delivery.is_open(request.request_id):
                continue
            request.output_ids[index] = sample.token_id
            if sample.token_id in request.stop_token_ids:
                with self._lock:
                    self.scheduler.cancel(request.request_id, FinishReason.STOP)
                request.finish_reason = FinishReason.STOP
            self.delivery.publish(request, sample)
        with self._lock:  # its time was unknown at the update: the cost model and the step target learn it now
            self.scheduler.observe(plan, output.outcome)
        self._account(plan, output, in_flight.t0, in_flight.t1, t2)
        return True

    def _read_back(self, step: Any, plan: StepPlan, updated: bool = False) -> Any:
        """`updated`: the scheduler took the step's update already (with placeholder tokens: a step left in flight)."""
        try:
            return self.runner.collect(step)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            self._fail_plan(plan, exc, updated)
            return None

    def _account(self, plan: StepPlan, output: Any, t0: float, t1: float, t2: float) -> None:
        self._prompt_rows += plan.prefill_rows
        self.observer.on_step(
            output.outcome.elapsed_ms, plan.num_rows, plan.prefill_rows,
            sum(1 for lane in plan.lanes if lane.kind.value == "decode"), plan.budget_reason.count("halved"),
        )
        if self.trace.enabled:
            trace_step(self.trace, plan, output, t0, t1, t2)

    def _fail_open_requests(self, reason: str) -> None:
        """Refuse new requests and finish every open and queued one with `reason` (the loop failed)."""
        self.failure, self._stopping = reason, True
        for control in _drain(self._controls):
            control.done.set_exception(EngineStopped(reason))
        for sub in [*self._taken, *_drain(self._submissions)]:  # taken: the loop failed while admitting them
            if not self.delivery.is_open(sub.request.request_id):
                self.delivery.open(sub.stream, sub.handle)
        for request_id in self.delivery.open_ids():
            try:
                self.delivery.finish(request_id, "error", None, error=reason)
            except Exception:  # the next request must still be told
                log.exception("failing request %s", request_id)
        self.delivery.flush()

    def _finish_on_stop_string(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.cancel(request_id, FinishReason.STOP)

    def _fail_plan(self, plan: StepPlan, exc: Exception, updated: bool = False) -> None:
        with self._lock:
            self.scheduler.abandon(plan, updated)
        for lane in plan.lanes:
            with self._lock:
                request = self.scheduler.cancel(lane.request_id, FinishReason.ERROR)
            self.delivery.finish(lane.request_id, "error", request, error=f"engine step failed: {exc}")


def _engine_thread(engine_ref: weakref.ref) -> None:
    """Run the loop, then park instead of returning.

    A returning thread destroys MLX's thread-local state (its compile cache) after `join()` has returned, and
    that destructor takes the GIL: at interpreter exit this aborts the process. A parked daemon thread is never
    torn down. It keeps no reference to the engine, so the model and KV pool are freed as usual.
    """
    engine = engine_ref()
    if engine is not None:
        try:
            engine._warm_up()
            engine._loop()
        except Exception as exc:  # a bug outside any step: no request may hang on a loop that is gone
            log.exception("the engine loop failed")
            engine._fail_open_requests(f"the engine stopped: {type(exc).__name__}: {exc}")
        finally:
            engine._drained.set()
    del engine
    threading.Event().wait()


_Item = TypeVar("_Item")


def _drain(items: queue.Queue[_Item]) -> list[_Item]:
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken


def _completion(handle: RequestHandle) -> Completion:
    """Everything one handle streamed, as one blocking result."""
    events = list(handle)
    last = events[-1]
    tokens = tuple(e.token_id for e in events if e.token_id is not None)
    logprobs = tuple(e.logprob for e in events if e.logprob is not None)
    prompt_logprobs = next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None)
    embedding = next((e.embedding for e in events if e.embedding is not None), None)
    return Completion(
        request_id=handle.request_id,
        token_ids=tokens,
        text="".join(e.text for e in events),
        finish_reason=last.finish_reason or "error",
        usage=last.usage,
        logprobs=logprobs or None,
        prompt_logprobs=prompt_logprobs,
        embedding=embedding,
        error=last.error,
    )
